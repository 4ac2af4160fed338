"""mergekit YAML read by ``forgetless merge``: the translation of its five methods, the refusals,
``--dry-run``, and the linear and DARE math against mergekit 0.1.5's formulas written by hand."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from forgetless.cli.app import main
from forgetless.errors import ConfigError
from forgetless.merging.config import DareMerge, MergeConfig, load_merge_config
from forgetless.merging.dare import dare_merge, drop, merge_dropped
from forgetless.merging.linear import combine, linear_update
from forgetless.merging.mergekit_yaml import translate
from forgetless.merging.ties import ties_merge


def _mergekit(method: str, params: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "merge_method": method,
        "base_model": "base",
        "models": [
            {"model": "a", "parameters": {"weight": 0.7, "density": 0.5}},
            {"model": "b", "parameters": {"weight": 0.3, "density": 0.3}},
        ],
        "dtype": "float32",
    }
    if method in ("linear", "task_arithmetic"):
        for entry in config["models"]:
            del entry["parameters"]["density"]
    return config | ({"parameters": params} if params else {}) | extra


def _read(data: dict[str, Any]) -> MergeConfig:
    return MergeConfig.model_validate(translate(data, "mk.yaml").config)


@pytest.mark.parametrize(
    ("method", "params", "native"),
    [
        ("linear", None, {"name": "linear", "normalize": True}),
        (
            "task_arithmetic",
            {"lambda": 0.5, "normalize": True, "int8_mask": True},
            {"name": "task_arithmetic", "scaling": 0.5, "normalize": True},
        ),
        (
            "ties",
            None,
            {"name": "ties", "convention": "mergekit", "density": [0.5, 0.3], "normalize": True},
        ),
        (
            "dare_ties",
            {"rescale": False},
            {"name": "dare", "drop_rate": [0.5, 0.7], "rescale": "none", "elect_sign": True},
        ),
        (
            "dare_linear",
            {"lambda": 2.0},
            {"name": "dare", "rescale": "l1", "elect_sign": False, "normalize": False},
        ),
    ],
)
def test_each_mergekit_method_translates(
    method: str, params: dict[str, Any] | None, native: dict[str, Any]
) -> None:
    found = translate(_mergekit(method, params), "mk.yaml")
    cfg = MergeConfig.model_validate(found.config)
    assert cfg.method.model_dump(mode="json").items() >= native.items()
    assert [(str(t.path), t.weight) for t in cfg.tasks] == [("a", 0.7), ("b", 0.3)]
    assert str(cfg.base_model) == "base" and cfg.dtype == "float32"
    assert found.notes[0] == f"read as mergekit's {method}"
    if method == "dare_linear":
        assert cfg.method.drop_rate == pytest.approx([0.5, 0.7])  # type: ignore[attr-defined]
        assert cfg.method.scaling == 2.0  # type: ignore[attr-defined]


def test_top_level_parameters_are_every_models_default() -> None:
    data = _mergekit("ties", {"density": 0.4, "weight": 0.5, "lambda": 0.9})
    data["models"] = [{"model": "a"}, {"model": "b", "parameters": {"weight": 1.0}}]
    cfg = _read(data)
    assert [t.weight for t in cfg.tasks] == [0.5, 1.0]
    assert cfg.method.density == 0.4 and cfg.method.scaling == 0.9  # type: ignore[attr-defined]


def test_a_listed_base_is_the_base_for_ties_and_a_model_for_linear() -> None:
    base_entry = {"model": "base"}  # no weight: mergekit does not read the base's parameters
    ties = _mergekit("ties")
    ties["models"].insert(0, base_entry)
    assert [str(t.path) for t in _read(ties).tasks] == ["a", "b"]
    linear = _mergekit("linear")
    linear["models"].insert(0, {"model": "base", "parameters": {"weight": 0.2}})
    assert [t.weight for t in _read(linear).tasks] == [0.2, 0.7, 0.3]
    alone = _mergekit("linear")
    del alone["base_model"]
    assert str(_read(alone).base_model) == "a"  # the first model


def test_dtype_out_dtype_and_the_mergekit_defaults() -> None:
    found = translate(_mergekit("ties", dtype="bfloat16", out_dtype="float16"), "x")
    assert found.config["dtype"] == "float16"
    assert any("bfloat16 rounding" in n for n in found.notes)
    plain = _mergekit("ties")
    del plain["dtype"]
    defaults = _read(plain)
    assert defaults.dtype == "base" and defaults.method.scaling == 1.0  # type: ignore[attr-defined]
    dare = _read(_mergekit("dare_linear")).method
    assert (dare.rescale, dare.normalize) == ("l1", False)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"merge_method": "slerp"}, "merge_method 'slerp'"),
        ({"slices": [], "tokenizer": {}}, "slices, tokenizer"),
        ({"parameters": {"gamma": 0.1}}, "parameters.gamma"),
        ({"parameters": {"weight": [0, 1]}}, "parameters.weight: gradients"),
        ({"parameters": {"normalize": "yes"}}, "parameters.normalize: must be true or false"),
        ({"parameters": {"rescale": True}}, "parameters.rescale: true"),
        ({"parameters": {"lambda": -1}}, "parameters.lambda"),
        ({"base_model": None}, "base_model: ties needs a base_model"),
        ({"base_model": "x+lora"}, "base_model: 'x+lora'"),
        ({"dtype": "float64"}, "dtype: 'float64'"),
        ({"tokenizer_source": "union"}, "tokenizer_source: 'union'"),
        ({"models": [{"model": "a", "parameters": {"normalize": True}}]}, "models[0].parameters"),
        ({"models": [{"model": "a", "parameters": {"gamma": 1}}]}, "models[0].parameters.gamma"),
        ({"models": [{"model": "a", "parameters": {"weight": {"a": 1}}}]}, "filters"),
        ({"models": [{"model": "a"}]}, "models[0].parameters.weight: missing"),
        ({"models": [{"model": "a", "layer_range": [0, 2]}]}, "models[0].layer_range"),
        ({"models": [{"model": "a", "parameters": {"weight": 1, "density": 2}}]}, "density 2.0"),
    ],
)
def test_what_forgetless_does_not_merge_is_one_line_naming_it(
    change: dict[str, Any], named: str
) -> None:
    data = _mergekit("ties") | change
    with pytest.raises(ConfigError) as err:
        translate(data, "mk.yaml")
    message = str(err.value)
    assert message.startswith("mk.yaml: ") and "\n" not in message and named in message


def test_per_task_values_come_one_per_task() -> None:
    tasks = [{"path": "a"}, {"path": "b", "weight": -1.0}]
    for method, named in [
        ({"name": "ties", "density": [0.5]}, "ties.density has 1 values for 2 tasks"),
        ({"name": "dare", "drop_rate": [0.5, 0.1, 0.2]}, "dare.drop_rate has 3 values"),
        ({"name": "linear"}, "linear: the tasks' weights sum to 0"),
    ]:
        with pytest.raises(ValidationError, match=named):
            MergeConfig.model_validate({"base_model": "x", "tasks": tasks, "method": method})


def test_a_yaml_naming_merge_method_is_read_as_mergekit(tmp_path: Path) -> None:
    path = tmp_path / "mk.yaml"
    path.write_text(yaml.safe_dump(_mergekit("dare_ties")), encoding="utf-8")
    cfg = load_merge_config(path)
    assert cfg.method.name == "dare" and cfg.method.elect_sign  # type: ignore[attr-defined]


# ---- the command: --dry-run writes nothing; a linear merge of a mergekit YAML on disk ----


def _invoke(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["forgetless", *args])
    code = 0
    try:
        main()
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def _noisy_copy(base: Path, out: Path, seed: int) -> Path:
    """``base`` with N(0, 0.01) added to every weight (config and safetensors only)."""
    out.mkdir()
    shutil.copy2(base / "config.json", out / "config.json")
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(base / "model.safetensors"))
    noisy = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()}
    save_file(noisy, str(out / "model.safetensors"))
    return out


def test_dry_run_prints_the_plan_and_writes_nothing(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = _mergekit("dare_ties", base_model=str(tiny_model_dir))
    (tmp_path / "mk.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # the models a and b, by relative path
    _noisy_copy(tiny_model_dir, tmp_path / "a", seed=1)
    out = tmp_path / "merged"
    code, text, err = _invoke(
        monkeypatch, capsys, "merge", str(tmp_path / "mk.yaml"), "--out", str(out), "--dry-run"
    )
    assert code == 2 and err == "error: tasks.1: no such folder: b", err  # checked, not planned
    _noisy_copy(tiny_model_dir, tmp_path / "b", seed=2)
    code, text, err = _invoke(
        monkeypatch, capsys, "merge", str(tmp_path / "mk.yaml"), "--out", str(out), "--dry-run"
    )
    assert code == 0, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "mk.yaml"]
    assert "method: dare (" in text and "elect_sign true" in text
    assert "task 2: b  weight 0.3  drop_rate 0.7" in text and "output dtype: float32" in text
    assert "tensors, " in text and "read as mergekit's dare_ties" in text
    code, _, err = _invoke(monkeypatch, capsys, "merge", str(tmp_path / "mk.yaml"))
    assert code == 2 and "--out DIR is needed" in err and "\n" not in err


def test_linear_mergekit_yaml_merges_to_the_weighted_mean(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tuned = _noisy_copy(tiny_model_dir, tmp_path / "tuned", seed=1)
    data = {
        "merge_method": "linear",
        "base_model": str(tiny_model_dir),
        "models": [
            {"model": str(tiny_model_dir), "parameters": {"weight": 0.25}},
            {"model": str(tuned), "parameters": {"weight": 0.5}},
        ],
    }
    (tmp_path / "mk.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    code, _, err = _invoke(
        monkeypatch, capsys, "merge", str(tmp_path / "mk.yaml"), "--out", str(tmp_path / "m")
    )
    assert code == 0, err
    base, other = (
        load_file(str(tiny_model_dir / "model.safetensors")),
        load_file(str(tuned / "model.safetensors")),
    )
    got = load_file(str(tmp_path / "m" / "model.safetensors"))
    for name, theta in base.items():
        want = (0.25 * theta + 0.5 * other[name]) / 0.75
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6)


# ---- the math against mergekit 0.1.5's formulas, written out here ----


def _mergekit_gta(
    deltas: list[torch.Tensor],
    masks: list[torch.Tensor | None],
    weights: list[float],
    ties: bool,
    normalize: bool,
    lam: float,
    rescale: bool,
) -> torch.Tensor:
    """mergekit's generalized task arithmetic (merge_group, get_mask, rescaled_masked_tensor)
    for the random sparsification, as it reads in mergekit 0.1.5."""
    rows = []
    for delta, mask in zip(deltas, masks, strict=True):
        if mask is not None:
            masked = delta * mask
            before, after = delta.abs().sum(), masked.abs().sum()
            if rescale and before >= 1e-7 and after >= 1e-7:
                masked = masked * (before / after)
            delta = masked
        rows.append(delta)
    stacked = torch.stack(rows)
    w = torch.tensor(weights).view(-1, *([1] * (stacked.ndim - 1)))
    stacked = stacked * w
    if ties:
        majority = (stacked.sum(dim=0) >= 0).float() * 2 - 1
        agree = stacked.sign() == majority
        mixed, divisor = (stacked * agree).sum(dim=0), (w * agree).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed, divisor = stacked.sum(dim=0), w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed = mixed / divisor
    return mixed * lam if lam != 1 else mixed


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(("normalize", "lam", "rescale"), [(False, 1.0, True), (True, 0.7, False)])
def test_dare_linear_and_dare_ties_equal_mergekits_formula(
    ties: bool, normalize: bool, lam: float, rescale: bool
) -> None:
    gen = torch.Generator().manual_seed(5)
    deltas = [0.01 * torch.randn(6, 9, generator=gen) for _ in range(3)]
    densities, weights = [0.5, 0.3, 1.0], [0.7, 0.3, 0.45]
    masks = [
        None if d >= 1 else torch.bernoulli(torch.full((6, 9), d), generator=gen) for d in densities
    ]
    dropped = [
        delta if mask is None else drop(delta, mask, 1 - d, "l1" if rescale else "none")
        for delta, mask, d in zip(deltas, masks, densities, strict=True)
    ]
    ours = merge_dropped(dropped, weights, ties, normalize, lam)
    theirs = _mergekit_gta(deltas, masks, weights, ties, normalize, lam, rescale)
    assert torch.equal(ours, theirs)


def test_dare_ties_and_dare_linear_by_hand() -> None:
    # kept entries a = [1, 2, 0], b = [4, −3, −2], weights 1 and 0.5 → w·b = [2, −1.5, −1]
    a, b = torch.tensor([1.0, 2.0, 0.0]), torch.tensor([4.0, -3.0, -2.0])
    linear = merge_dropped([a, b], [1.0, 0.5], elect_sign=False, normalize=False, scaling=2.0)
    assert torch.equal(linear, torch.tensor([6.0, 1.0, -2.0]))
    # signs: entry 0 both +; entry 1: 2 − 1.5 ≥ 0 → + (b drops out); entry 2: a's 0 has no sign
    ties = merge_dropped([a, b], [1.0, 0.5], elect_sign=True, normalize=False, scaling=1.0)
    assert torch.equal(ties, torch.tensor([3.0, 2.0, -1.0]))
    mean = merge_dropped([a, b], [1.0, 0.5], elect_sign=True, normalize=True, scaling=1.0)
    assert torch.equal(mean, torch.tensor([2.0, 2.0, -2.0]))  # over agreeing weights 1.5, 1, 0.5


def test_dare_l1_rescale_keeps_the_norm_and_none_keeps_the_entries() -> None:
    delta = torch.tensor([1.0, -2.0, 3.0, -4.0])
    keep = torch.tensor([1.0, 0.0, 1.0, 0.0])
    l1 = drop(delta, keep, 0.5, "l1")
    assert torch.equal(l1, torch.tensor([1.0, 0.0, 3.0, 0.0]) * 2.5)  # ‖τ‖₁ 10 / kept 4
    assert torch.equal(drop(delta, keep, 0.5, "none"), torch.tensor([1.0, 0.0, 3.0, 0.0]))
    assert torch.equal(drop(delta, keep, 0.5, "inverse"), torch.tensor([2.0, 0.0, 6.0, 0.0]))
    tiny = torch.full((4,), 1e-9)  # below mergekit's 1e-7 floor: kept entries left unscaled
    assert torch.equal(drop(tiny, keep, 0.5, "l1"), tiny * keep)


def test_dare_merge_takes_one_drop_rate_per_task() -> None:
    deltas = [torch.full((20, 20), 8.0), torch.randint(1, 5, (20, 20)).float()]  # exact sums
    params = DareMerge(name="dare", drop_rate=[0.0, 0.9], rescale="none")
    merged = dare_merge(params, deltas, [1.0, 1.0], index=3)
    rest = merged - deltas[0]  # task 1 is whole; task 2 keeps about 10% of its entries
    assert torch.equal(rest[rest != 0], deltas[1][rest != 0])
    assert 0.02 < float((rest != 0).float().mean()) < 0.25
    assert torch.equal(merged, dare_merge(params, deltas, [1.0, 1.0], index=3))  # seeded


def test_linear_update_gives_mergekits_weighted_mean() -> None:
    base = torch.randn(5, 4)
    models = [base + 0.1 * torch.randn(5, 4) for _ in range(3)]
    weights = [0.2, 0.5, 0.3]
    deltas = [m - base for m in models]
    summed = torch.zeros(5, 4)  # mergekit's linear: Σ w θ, then / Σ w
    for model, weight in zip(models, weights, strict=True):
        summed.add_(model * weight)
    got = base + linear_update(base, deltas, weights, normalize=True)
    torch.testing.assert_close(got, summed / sum(weights), rtol=0, atol=1e-6)
    plain = base + linear_update(base, deltas, weights, normalize=False)
    torch.testing.assert_close(plain, summed, rtol=0, atol=1e-6)
    with pytest.raises(ValueError):
        linear_update(base, deltas, [1.0, -1.0, 0.0])


def test_task_arithmetic_rounds_each_weighted_vector_as_mergekit() -> None:
    deltas = [0.01 * torch.randn(300) for _ in range(3)]
    weights = [0.7, 0.3, 0.45]
    stacked = torch.stack(deltas) * torch.tensor(weights).view(-1, 1)
    assert torch.equal(combine(deltas, weights), stacked.sum(dim=0))
    total = stacked.sum(dim=0)
    assert torch.equal(combine(deltas, weights, True, 0.8), total / torch.tensor(1.45) * 0.8)


def test_ties_takes_one_density_per_task() -> None:
    a, b = torch.tensor([1.0, -2.0, 3.0, 4.0]), torch.tensor([0.5, 0.1, -0.2, 0.3])
    merged = ties_merge([a, b], [1.0, 0.5], convention="mergekit", normalize=False)
    assert torch.equal(merged, a + torch.tensor([0.5, 0.0, 0.0, 0.3]))  # b keeps its top 2
