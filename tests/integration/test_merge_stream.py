"""Streaming merge over safetensors and the ``forgetless merge`` command, on the tiny model."""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from forgetless.cli.app import main
from forgetless.errors import ConfigError
from forgetless.merging import ties_merge
from forgetless.merging.config import MergeConfig
from forgetless.merging.streaming import StreamWriter, stream_merge


@pytest.fixture(scope="module")
def tasks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two full checkpoints (base + noise) and one LoRA adapter with non-zero B."""
    root = tmp_path_factory.mktemp("merge-tasks")
    out: dict[str, Path] = {}
    for i in (1, 2):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(str(root / f"full{i}"))
        out[f"full{i}"] = root / f"full{i}"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    lora = LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(model, lora)
    peft_model.save_pretrained(str(root / "adapter"))
    peft_model.merge_and_unload().save_pretrained(str(root / "adapter-merged"))
    out["adapter"], out["adapter_merged"] = root / "adapter", root / "adapter-merged"
    return out


def _config(
    base: Path, paths: list[Path], method: dict, weights: list[float] | None = None
) -> MergeConfig:  # type: ignore[type-arg]
    weights = weights or [1.0] * len(paths)
    return MergeConfig.model_validate(
        {
            "base_model": str(base),
            "tasks": [{"path": str(p), "weight": w} for p, w in zip(paths, weights, strict=True)],
            "method": method,
        }
    )


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_stream_writer_matches_save_file(tmp_path: Path) -> None:
    tensors = {"b": torch.randn(3, 2), "a": torch.arange(5), "c": torch.randn(4).to(torch.bfloat16)}
    writer = StreamWriter(
        tmp_path / "x.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    )
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    assert not (tmp_path / "x.safetensors").exists()  # only the temp file until close
    writer.close()
    save_file(tensors, str(tmp_path / "y.safetensors"))
    got, want = (
        load_file(str(tmp_path / "x.safetensors")),
        load_file(str(tmp_path / "y.safetensors")),
    )
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_stream_equals_in_memory_task_arithmetic_and_loads(
    tiny_model_dir: Path, tasks: dict[str, Path], tmp_path: Path
) -> None:
    paths = [tasks["full1"], tasks["full2"]]
    cfg = _config(tiny_model_dir, paths, {"name": "task_arithmetic", "scaling": 0.5}, [1.0, 0.4])
    stream_merge(cfg, tmp_path / "out")
    base, t1, t2 = _weights(tiny_model_dir), _weights(paths[0]), _weights(paths[1])
    got = _weights(tmp_path / "out")
    for name, theta in base.items():
        want = theta + 0.5 * ((t1[name] - theta) + 0.4 * (t2[name] - theta))
        assert torch.allclose(got[name], want, atol=1e-6), name
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert torch.allclose(model.state_dict()["model.norm.weight"], got["model.norm.weight"])
    assert (tmp_path / "out" / "tokenizer.json").is_file() or (
        tmp_path / "out" / "tokenizer_config.json"
    ).is_file()


def test_stream_ties_equals_in_memory(
    tiny_model_dir: Path, tasks: dict[str, Path], tmp_path: Path
) -> None:
    paths = [tasks["full1"], tasks["full2"]]
    stream_merge(_config(tiny_model_dir, paths, {"name": "ties", "density": 0.3}), tmp_path / "o")
    base, t1, t2 = _weights(tiny_model_dir), _weights(paths[0]), _weights(paths[1])
    got = _weights(tmp_path / "o")
    for name, theta in base.items():
        want = theta + ties_merge([t1[name] - theta, t2[name] - theta], 0.3)
        assert torch.allclose(got[name], want, atol=1e-6), name


def test_lora_adapter_enters_as_scaled_b_a(
    tiny_model_dir: Path, tasks: dict[str, Path], tmp_path: Path
) -> None:
    cfg = _config(tiny_model_dir, [tasks["adapter"]], {"name": "task_arithmetic"})
    stream_merge(cfg, tmp_path / "o")
    got, want = _weights(tmp_path / "o"), _weights(tasks["adapter_merged"])
    base = _weights(tiny_model_dir)
    changed = [n for n in base if not torch.equal(base[n], want[n])]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)
    assert all(torch.allclose(got[n], want[n], atol=1e-6) for n in base)


@pytest.mark.parametrize(
    "method",
    [{"name": "ties"}, {"name": "dare", "drop_rate": 0.5}, {"name": "gcwm", "rank": 4}],
)
def test_weight_zero_returns_the_base(
    method: dict,  # type: ignore[type-arg]
    tiny_model_dir: Path,
    tasks: dict[str, Path],
    tmp_path: Path,
) -> None:
    cfg = _config(tiny_model_dir, [tasks["full1"], tasks["adapter"]], method, [0.0, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import forgetless.experimental.gcwm_merge  # noqa: F401  (registers gcwm)

        stream_merge(cfg, tmp_path / "o")
    got, base = _weights(tmp_path / "o"), _weights(tiny_model_dir)
    assert all(torch.allclose(got[n], base[n], atol=1e-7) for n in base)


def test_an_unregistered_experimental_rule_is_one_line_before_any_write(
    tiny_model_dir: Path, tasks: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forgetless.merging import streaming

    cfg = _config(tiny_model_dir, [tasks["full1"]], {"name": "gcwm", "rank": 4})
    monkeypatch.delitem(streaming.TENSOR_RULES, "gcwm", raising=False)
    with pytest.raises(ConfigError, match=r"import forgetless\.experimental\.gcwm_merge") as e:
        stream_merge(cfg, tmp_path / "o")
    assert "\n" not in str(e.value) and not (tmp_path / "o").exists()


def test_opcm_stream_keeps_the_mean_task_norm(
    tiny_model_dir: Path, tasks: dict[str, Path], tmp_path: Path
) -> None:
    paths = [tasks["full1"], tasks["full2"]]
    stats = stream_merge(
        _config(tiny_model_dir, paths, {"name": "opcm", "alpha": 0.5}), tmp_path / "o"
    )
    base, got = _weights(tiny_model_dir), _weights(tmp_path / "o")
    norms = [
        sum(float((_weights(p)[n] - base[n]).pow(2).sum()) for n in base) ** 0.5 for p in paths
    ]
    merged = sum(float((got[n] - base[n]).pow(2).sum()) for n in base) ** 0.5
    assert merged == pytest.approx(sum(norms) / 2, rel=1e-4)
    assert stats.scalars["opcm_lambda"] > 1.0  # two nearly orthogonal updates: ‖R‖ ≈ √2·mean
    assert all(0 < n <= stats.tensors for n in stats.changed)  # each tensor counted once


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


def test_cli_merge_writes_a_loadable_model(
    tiny_model_dir: Path,
    tasks: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "merge.yaml"
    data = {
        "base_model": str(tiny_model_dir),
        "tasks": [{"path": str(tasks["full1"])}, {"path": str(tasks["adapter"]), "weight": 0.5}],
        "method": {"name": "gcwm", "rank": 4},
    }
    config.write_text(yaml.safe_dump(data), encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, out, _ = _invoke(
            monkeypatch, capsys, "merge", str(config), "--out", str(tmp_path / "m")
        )
    assert code == 0 and "merged 2 task(s) by gcwm" in out
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert (tmp_path / "m" / "merge.json").is_file()


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ({"name": "ties", "density": 2}, "method.ties.density"),
        ({"name": "ties", "trim": 1}, "method.ties.trim"),
    ],
)
def test_cli_bad_merge_config_is_one_line(
    method: dict,  # type: ignore[type-arg]
    expected: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        yaml.safe_dump(
            {"base_model": str(tiny_model_dir), "tasks": [{"path": "x"}], "method": method}
        ),
        encoding="utf-8",
    )
    code, _, err = _invoke(monkeypatch, capsys, "merge", str(config), "--out", str(tmp_path / "m"))
    assert code == 2 and err.startswith("error: ") and "\n" not in err and expected in err
    assert not (tmp_path / "m").exists()


def test_a_lora_runs_task_checkpoint_names_the_adapter_to_merge(
    tiny_model_dir: Path, tasks: dict[str, Path], tmp_path: Path
) -> None:
    checkpoint = tmp_path / "checkpoints" / "task-01-reverse"  # as a LoRA run keeps one
    shutil.copytree(tasks["adapter"], checkpoint / "adapters" / "default")
    with pytest.raises(ConfigError) as caught:
        stream_merge(
            _config(tiny_model_dir, [tasks["full1"], checkpoint], {"name": "ties"}), tmp_path / "o"
        )
    assert str(caught.value) == (
        f"tasks.1: {checkpoint} holds LoRA adapters, not a model's weights; give one: "
        f"{checkpoint / 'adapters' / 'default'}"
    )
    assert not (tmp_path / "o").exists()
