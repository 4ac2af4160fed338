"""Head masking (DBM), batched necessity/sufficiency and circuit metrics on tiny models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from forgetless.config.schema import TinyModelConfig
from forgetless.diagnostics import circuit_metrics as cm
from forgetless.diagnostics.circuits import (
    counterfactual,
    effect_masks,
    head_activations,
    head_effects,
    head_effects_attribution,
    head_effects_loop,
    head_layout,
    mask_temperature,
    mask_values,
    masked_logits,
    o_proj_modules,
    target_logprob,
    train_masks,
)
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.tasks.base import Example
from forgetless.tasks.formatting import IGNORE_INDEX, collate, completion_window, encode_example

TOKENIZER = build_char_tokenizer()
GQA = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)


def _model(arch: str = "qwen2") -> nn.Module:
    model = build_tiny_model(GQA.model_copy(update={"arch": arch}), len(TOKENIZER), seed=0)
    return model.eval()


def _batch(words: tuple[str, ...] = ("abc", "hello", "xyz", "qrst")) -> dict[str, torch.Tensor]:
    feats = [encode_example(TOKENIZER, Example(f"cp {w}=", w), 32) for w in words]
    return collate(feats, TOKENIZER.pad_token_id)


def _replaced(model: nn.Module, batch: dict[str, torch.Tensor], cf: list[torch.Tensor]) -> Any:
    """Independent reference: every o_proj input replaced wholesale by the counterfactual."""
    layout = head_layout(model)

    def hook(i: int) -> Any:
        def pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            full = cf[i].expand(x.shape[0], x.shape[1], layout.heads, layout.head_dim)
            return (full.reshape(x.shape).contiguous(),)

        return pre

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(o_proj_modules(model))]
    try:
        with torch.no_grad():
            return model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("kind", ["mean", "corrupt"])
def test_all_ones_is_clean_and_all_zeros_is_counterfactual(arch: str, kind: str) -> None:
    model, batch = _model(arch), _batch()
    corrupt = _batch(("xyz", "world", "abc", "mnop"))  # same lengths, other letters
    cf = counterfactual(model, batch, kind, corrupt)  # type: ignore[arg-type]
    layout = head_layout(model)
    assert (layout.heads, layout.head_dim) == (4, 8)  # GQA: 4 query heads, 2 key/value heads
    with torch.no_grad():
        clean = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ones = masked_logits(model, batch, torch.ones(layout.layers, layout.heads), cf)
        zeros = masked_logits(model, batch, torch.zeros(layout.layers, layout.heads), cf)
    window = ones.shape[1]  # the completion window: the prompt's logits are never read
    assert window == completion_window(batch["labels"]) < clean.shape[1]
    assert torch.allclose(ones, clean[:, -window:], atol=1e-6)
    assert torch.allclose(zeros, _replaced(model, batch, cf)[:, -window:], atol=1e-6)
    assert not torch.allclose(zeros, clean[:, -window:], atol=1e-3)
    full = target_logprob(clean, batch["labels"])
    assert torch.allclose(target_logprob(ones, batch["labels"]), full, atol=1e-5)


def test_per_row_masks_match_separate_runs() -> None:
    model, batch = _model(), _batch()
    cf = counterfactual(model, batch, "mean")
    masks = torch.rand(3, 2, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiled = masked_logits(model, batch, masks.repeat_interleave(4, dim=0), cf)
        for i in range(3):
            alone = masked_logits(model, batch, masks[i], cf)
            assert torch.allclose(tiled[4 * i : 4 * i + 4], alone, atol=1e-5)


def test_batched_effects_equal_one_head_at_a_time() -> None:
    model, batch = _model("llama"), _batch()
    cf = counterfactual(model, batch, "mean")
    batched, chunked = head_effects(model, batch, cf), head_effects(model, batch, cf, chunk=5)
    loop = head_effects_loop(model, batch, cf)
    n = head_layout(model).size
    assert batched.forward_passes == 1 and loop.forward_passes == 2 * n + 2
    assert chunked.forward_passes == -(-(2 * n + 2) // 5)
    for got in (batched, chunked):
        assert got.full == pytest.approx(loop.full, abs=1e-4)
        assert got.empty == pytest.approx(loop.empty, abs=1e-4)
        assert torch.allclose(got.necessity, loop.necessity, atol=1e-4)
        assert torch.allclose(got.sufficiency, loop.sufficiency, atol=1e-4)
    assert loop.necessity.abs().sum() > 0 and loop.sufficiency.abs().sum() > 0
    assert effect_masks(head_layout(model)).shape == (2 * n + 2, 2, 4)


PLANTED = {(0, 1), (1, 2)}


def _planted_model() -> nn.Module:
    """Only the planted heads write to the residual stream (the others' o_proj columns are 0);
    embeddings and planted heads are scaled up so the model's predictions are sharp and depend
    on those heads."""
    model = _model()
    layout = head_layout(model)
    with torch.no_grad():
        model.get_input_embeddings().weight *= 10.0  # type: ignore[operator]
        for layer, proj in enumerate(o_proj_modules(model)):
            for head in range(layout.heads):
                cols = slice(head * layout.head_dim, (head + 1) * layout.head_dim)
                scale = 10.0 if (layer, head) in PLANTED else 0.0
                proj.weight[:, cols] *= scale  # type: ignore[index, operator]
    return model


def _head_targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """A behaviour the heads carry: at each completion position the target is the token whose
    logit the heads raise most (clean minus all-patched), so m(M) > m(∅) by construction."""
    batch = _batch()
    cf = counterfactual(model, batch, "mean")
    with torch.no_grad():
        clean = masked_logits(model, batch, torch.ones(2, 4), cf)
        patched = masked_logits(model, batch, torch.zeros(2, 4), cf)
    promoted = (clean - patched)[:, :-1].argmax(-1)  # over the completion window
    labels = batch["labels"].clone()
    window = labels[:, -clean.shape[1] :]  # a view: writing to it writes to labels
    keep = window[:, 1:] != IGNORE_INDEX
    window[:, 1:][keep] = promoted[keep]
    return {**batch, "labels": labels}, cf


def test_planted_circuit_is_recovered() -> None:
    model = _planted_model()
    batch, cf = _head_targets(model)
    result = train_masks(model, batch, cf, steps=80, lr=0.1, sparsity=0.05)
    found = {tuple(ix) for ix in result.binary.nonzero().tolist()}
    assert found == PLANTED
    assert all(p.requires_grad for p in model.parameters()), "the model is unfrozen after"
    effects = head_effects(model, batch, cf)
    circuit = cm.faithfulness(
        _m(model, batch, result.binary.float(), cf), effects.empty, effects.full
    )
    assert circuit == pytest.approx(1.0, abs=1e-4)  # the others do nothing: C is faithful
    idle = [(ly, h) for ly in range(2) for h in range(4) if (ly, h) not in PLANTED]
    assert all(abs(float(effects.necessity[ly, h])) < 1e-5 for ly, h in idle)


@pytest.mark.parametrize(
    "binary", [{"final_temperature": 0.02}, {"straight_through": True}], ids=["anneal", "st"]
)
def test_binary_masks_recover_the_planted_circuit(binary: dict[str, Any]) -> None:
    model = _planted_model()
    batch, cf = _head_targets(model)
    soft = train_masks(model, batch, cf, steps=80, lr=0.1, sparsity=0.05)
    hard = train_masks(model, batch, cf, steps=80, lr=0.1, sparsity=0.05, **binary)
    assert {tuple(ix) for ix in hard.binary.nonzero().tolist()} == PLANTED
    if "final_temperature" in binary:  # annealed: the masks end (near) 0 or 1
        assert hard.gap < 0.01 < soft.gap
    assert mask_temperature(0, 80, 1.0, 0.02) == 1.0
    assert mask_temperature(79, 80, 1.0, 0.02) == pytest.approx(0.02)
    values = mask_values(torch.tensor([2.0, -1.0], requires_grad=True), 1.0, True)
    assert values.tolist() == [1.0, 0.0]


def test_attribution_effects_rank_heads_as_exact_patching_does() -> None:
    """First-order effects: the planted heads carry all of it, idle heads read exactly 0, and
    on an unplanted model the heads rank as the exact 2N + 2 passes rank them."""
    planted = _planted_model()
    batch, cf = _head_targets(planted)
    exact, first = head_effects(planted, batch, cf), head_effects_attribution(planted, batch, cf)
    assert first.forward_passes == 2
    assert (first.full, first.empty) == (pytest.approx(exact.full), pytest.approx(exact.empty))
    for got, want in ((first.necessity, exact.necessity), (first.sufficiency, exact.sufficiency)):
        assert {tuple(ix) for ix in got.nonzero().tolist()} == PLANTED
        assert torch.allclose(got, want, rtol=0.2)
    model, batch = _model("llama"), _batch()
    cf = counterfactual(model, batch, "mean")
    exact, first = head_effects(model, batch, cf), head_effects_attribution(model, batch, cf)
    for got, want in ((first.necessity, exact.necessity), (first.sufficiency, exact.sufficiency)):
        ranks = [t.flatten().argsort().argsort().float() for t in (got, want)]
        assert torch.corrcoef(torch.stack(ranks))[0, 1] > 0.9
    assert all(p.requires_grad for p in model.parameters()), "the model is unfrozen after"


def _m(model: nn.Module, batch: dict[str, torch.Tensor], mask: torch.Tensor, cf: Any) -> float:
    with torch.no_grad():
        return float(target_logprob(masked_logits(model, batch, mask, cf), batch["labels"]).mean())


def test_target_logprob_counts_only_targets() -> None:
    logits = torch.zeros(1, 4, 5)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 2, 3]])
    assert float(target_logprob(logits, labels)[0]) == pytest.approx(
        2 * torch.log(torch.tensor(0.2))
    )
    acts = head_activations(_model(), _batch())
    assert acts[0].shape[-2:] == (4, 8)


def test_circuit_metrics_on_hand_made_masks() -> None:
    base = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    tuned = torch.tensor([[1, 0, 0, 1], [1, 0, 1, 1]], dtype=torch.bool)
    assert cm.circuit_size(base) == 4 and cm.circuit_fraction(tuned) == 5 / 8
    assert cm.retention(base, tuned) == 3 / 4
    assert cm.retention(torch.zeros(2, 2, dtype=torch.bool), tuned[:, :2]) is None
    assert cm.faithfulness(-3.0, -10.0, -2.0) == pytest.approx(7 / 8)
    assert cm.faithfulness(-3.0, -2.0, -2.0) is None
    assert cm.dcm_score(-3.0, -10.0) == 7.0
    shifts = cm.mask_shifts(
        torch.tensor([[0.9, 0.5], [0.2, 0.8]]), torch.tensor([[0.95, 0.1], [0.6, 0.8]]), 0.1
    )
    assert shifts.classes == [["preserved", "weakened"], ["amplified", "preserved"]]
    assert shifts.counts == {"preserved": 2, "amplified": 1, "weakened": 1}
    nec = torch.tensor([[4.0, 0.1], [0.0, 2.0]])
    suf = torch.tensor([[3.0, 5.0], [0.0, 0.5]])
    assert cm.critical_specialists(nec, suf, -2.0, -12.0, 0.1) == [(0, 0)]
    assert cm.critical_specialists(nec, suf, -2.0, -12.0, 0.05) == [(0, 0), (1, 1)]


def test_differential_vulnerability() -> None:
    sft = torch.tensor([[0.1, 0.9, 0.5], [0.2, 0.95, 0.7]])
    rl = torch.tensor([[0.8, 0.9, 0.2], [0.9, 0.9, 0.7]])
    v = cm.differential_vulnerability(sft, rl, delta=0.1)
    assert v.labels == [
        ["a_vulnerable", "neutral", "b_vulnerable"],
        ["a_vulnerable", "neutral", "neutral"],
    ]
    assert v.overall["a_vulnerable"] == 2 and v.overall["b_vulnerable"] == 1
    assert v.per_layer[1]["a_vulnerable_share"] == pytest.approx(1 / 3)
    within = torch.tensor([[True, False, False], [True, True, False]])
    restricted = cm.differential_vulnerability(sft, rl, 0.1, within)
    assert restricted.overall["heads"] == 3 and restricted.overall["b_vulnerable"] == 0
    assert restricted.overall["mean_score"] == pytest.approx((0.7 + 0.7 - 0.05) / 3)


def _checkpoints(root: Path) -> list[Path]:
    """A base and two perturbed copies named like the rl method's epoch folders."""
    folders = []
    for i, name in enumerate(["start", "sft-epoch-1", "rl-epoch-1"]):
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * i * torch.randn_like(p))
        model.save_pretrained(str(root / name))
        TOKENIZER.save_pretrained(str(root / name))
        folders.append(root / name)
    return folders


def test_diagnose_circuits_and_drift_commands(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from forgetless.cli.app import app

    folders = [str(f) for f in _checkpoints(tmp_path)]
    runner = CliRunner()
    args = ["diagnose", "circuits", *folders, "--behaviour", "copy", "--n", "4", "--steps", "5"]
    result = runner.invoke(app, [*args, "--counterfactual", "corrupt"])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "circuits.json").read_text())
    assert [r["model"] for r in data["rows"]] == ["start", "sft-epoch-1", "rl-epoch-1"]
    assert data["rows"][1]["retention"] is not None and "retention" not in data["rows"][0]
    assert data["vulnerability"][0]["a"] == "sft-epoch-1"
    assert (tmp_path / "circuits_masks.png").is_file()
    assert (tmp_path / "circuits_retention.png").is_file()
    assert "| start |" in (tmp_path / "circuits.md").read_text()
    first = tmp_path / "first.json"
    result = runner.invoke(app, [*args, "--effects", "attribution", "--out", str(first)])
    assert result.exit_code == 0, result.output
    rows = json.loads(first.read_text())["rows"]
    assert [r["forward_passes"]["effects"] for r in rows] == [2, 2, 2]
    assert data["rows"][0]["forward_passes"]["effects"] == 1  # exact: 2N + 2 masks in one pass
    result = runner.invoke(app, [*args, "--effects", "linear"])
    assert result.exit_code != 0 and "--effects must be exact or attribution" in result.output
    result = runner.invoke(app, ["diagnose", "drift", *folders, "--probes", "copy,add", "--n", "4"])
    assert result.exit_code == 0, result.output
    drift = json.loads((tmp_path / "drift.json").read_text())["rows"]
    assert drift[0]["kl_base_to_model"] == pytest.approx(0.0, abs=1e-6)
    assert drift[2]["kl_base_to_model"] > drift[1]["kl_base_to_model"] > 0


def test_the_retention_plot_has_a_point_per_checkpoint_not_named_by_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checkpoints named by epoch (sft-epoch-N, rl-epoch-N) are lines per objective; any other
    names get one point each, in the order given (the plot was left empty for them)."""
    from forgetless.diagnostics import diagnose_circuits as dc

    monkeypatch.setattr(dc, "_save", lambda fig, path, **kw: fig)
    rows = [
        {"model": "base", "retention": None},
        {"model": "/x/exp_t1", "retention": 1.0},
        {"model": "/x/exp_t2", "retention": 0.5},
    ]
    fig: Any = dc.plot_retention(rows, Path("unused.png"))
    (line,) = fig.axes[0].get_lines()
    assert list(line.get_ydata()) == [1.0, 0.5]
    epochs = [{"model": f"/r/sft-epoch-{i}", "retention": 1.0 - i / 10} for i in (1, 2)]
    fig = dc.plot_retention(rows[:1] + epochs, Path("unused.png"))
    assert [list(x.get_xdata()) for x in fig.axes[0].get_lines()] == [[1, 2]]
