"""LRP rules conserve relevance; parameter relevance covers every block; the gate does what the
paper's update rule says (R̄ = 1 freezes, R̄ = 0.5 halves, R̄ = 0 is seq_ft)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from torch import nn

from forgetless.attribution.importance import (
    MapAccumulator,
    gate_update_,
    historical_max,
    jaccard,
    keep_factor,
    normalize_relevance,
    overlap,
    permuted_maps,
    random_jaccard,
    rank_fraction,
    top_set,
)
from forgetless.attribution.relevance import (
    RelevanceError,
    lrp_mode,
    relevance_session,
    sample_relevance,
)
from forgetless.attribution.rules import (
    identity_rmsnorm,
    identity_silu,
    uniform_matmul,
    uniform_product,
)
from forgetless.config.loading import validate_config
from forgetless.config.schema import TinyModelConfig
from forgetless.methods.attribution_gate import AttributionGate, AttributionGateConfig
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.training.runner import Runner

CONSERVATION_RTOL = 1e-4  # float32 sums over a few thousand terms


def _relevance(t: torch.Tensor) -> float:
    assert t.grad is not None
    return float((t * t.grad).sum())


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("op", [uniform_product, uniform_matmul], ids=["product", "matmul"])
def test_bilinear_rule_splits_relevance_in_half(op: Any) -> None:
    a, b = _leaf(4, 5), _leaf(4, 5) if op is uniform_product else _leaf(5, 3)
    out = op(a, b)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    total = float((out * upstream).detach().sum())
    assert total != 0.0
    assert _relevance(a) == pytest.approx(0.5 * total, rel=1e-10)
    assert _relevance(b) == pytest.approx(0.5 * total, rel=1e-10)


def test_identity_rule_passes_relevance_through_silu() -> None:
    x = _leaf(64)
    out = identity_silu(x)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    assert torch.allclose(x * x.grad, out * upstream)
    assert torch.allclose(out, nn.functional.silu(x))


def _tiny(arch: str, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    cfg = TinyModelConfig(
        hidden_size=32,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=64,
        arch=arch,
    )
    return build_tiny_model(cfg, vocab_size=len(build_char_tokenizer()), seed=0).eval()


def _batch(n: int = 1, length: int = 12) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, 40, (n, length), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, : length // 2] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_lrp_mode_keeps_the_forward_and_is_undone(arch: str) -> None:
    model = _tiny(arch)
    batch = _batch(2)
    before = model(input_ids=batch["input_ids"]).logits
    implementation = model.config._attn_implementation
    with lrp_mode(model):
        during = model(input_ids=batch["input_ids"]).logits
    assert torch.allclose(before, during, atol=1e-5)
    assert model.config._attn_implementation == implementation
    assert "forward" not in model.model.layers[0].mlp.__dict__


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_relevance_is_conserved_through_linear_and_mlp_blocks(arch: str) -> None:
    model = _tiny(arch)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str) -> Any:
        def hook(_: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            inputs[0].retain_grad()
            out.retain_grad()
            seen[name] = (inputs[0], out)

        return hook

    layer = model.model.layers[1]
    handles = [
        layer.mlp.register_forward_hook(keep("mlp")),
        layer.self_attn.o_proj.register_forward_hook(keep("o_proj")),
    ]
    with lrp_mode(model), torch.enable_grad():
        logits = model(input_ids=_batch()["input_ids"]).logits
        logits[0, -1].max().backward()
    for handle in handles:
        handle.remove()
    for name, (inp, out) in seen.items():
        r_in, r_out = _relevance(inp), _relevance(out)
        assert r_out != 0.0, name
        assert r_in == pytest.approx(r_out, rel=CONSERVATION_RTOL), name
    # a bias-free linear map: its weight's relevance also sums to its output's
    weight = layer.self_attn.o_proj.weight
    assert _relevance(weight) == pytest.approx(_relevance(seen["o_proj"][1]), rel=CONSERVATION_RTOL)


def test_identity_rule_passes_relevance_through_rmsnorm() -> None:
    x, weight = _leaf(3, 16), torch.rand(16, dtype=torch.float64) + 0.5
    out = identity_rmsnorm(x, weight, 1e-6)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    assert torch.allclose(x * x.grad, out * upstream)
    reference = weight * x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    assert torch.allclose(out, reference)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_parameter_relevance_is_finite_and_nontrivial_for_every_block(arch: str) -> None:
    model = _tiny(arch)
    result = sample_relevance(model, _batch())
    kinds = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for layer in range(2):
        for kind in kinds:
            part = "self_attn" if kind.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            rel = result.relevance[f"model.layers.{layer}.{part}.{kind}.weight"]
            assert torch.isfinite(rel).all(), kind
            assert rel.abs().sum() > 0, kind
    assert all(p.grad is None for p in model.parameters())


def test_a_session_scores_like_one_call_per_sample_and_skips_wrong_backwards() -> None:
    model = _tiny("qwen2").train()
    batches = [_batch(length=n) for n in (9, 12, 15)]
    single = [sample_relevance(model, b) for b in batches]
    right = {**batches[0], "labels": batches[0]["labels"].clone()}
    where = right["labels"][:, 1:] != -100
    with torch.no_grad():
        predicted = model(input_ids=right["input_ids"]).logits[:, :-1].argmax(-1)
    right["labels"][:, 1:][where] = predicted[where]  # greedy decoding reproduces these labels
    with relevance_session(model) as score:
        shared = [score(b) for b in batches]
        skipped = [score(b, correct_only=True) for b in [*batches, right]]
    for one, many in zip(single, shared, strict=True):
        assert one.correct == many.correct and one.relevance.keys() == many.relevance.keys()
        assert all(torch.allclose(one.relevance[n], many.relevance[n]) for n in one.relevance)
    assert [r.correct for r in skipped] == [False, False, False, True]
    assert [bool(r.relevance) for r in skipped] == [False, False, False, True]
    assert model.training and all(p.grad is None for p in model.parameters())
    assert "forward" not in model.model.layers[0].mlp.__dict__


def test_lora_relevance_covers_frozen_weights_and_both_factors() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny("qwen2"), LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    result = sample_relevance(model, _batch())
    names = list(result.relevance)
    for needle in ["lora_A", "lora_B", "base_layer.weight"]:
        hits = [n for n in names if needle in n and "down_proj" in n]
        assert hits and all(result.relevance[n].abs().sum() > 0 for n in hits), needle
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen


def test_unsupported_activation_is_named() -> None:
    model = _tiny("llama")
    model.config.hidden_act = "gelu"
    with pytest.raises(RelevanceError, match="gelu"), lrp_mode(model):
        pass
    assert "forward" not in model.model.layers[0].mlp.__dict__


def test_normalization_is_scale_free_and_bounded() -> None:
    rel = torch.randn(50, 40)
    norm = normalize_relevance(rel, 0.05)
    assert torch.allclose(norm, normalize_relevance(rel * 1e-6, 0.05), atol=1e-6)
    assert norm.min() >= 0 and norm.max() == 1.0
    top = top_set(rel.abs(), 0.05)
    assert bool((norm[top] == 1.0).float().mean() > 0.3)
    assert torch.equal(normalize_relevance(torch.zeros(3, 3)), torch.zeros(3, 3))


def test_positive_sign_drops_negative_evidence_and_quantile_is_a_uniform_rank() -> None:
    rel = torch.tensor([-4.0, 1.0, 2.0, 0.5])
    positive = normalize_relevance(rel, 0.25, False, "positive")
    assert positive[0] == 0 and positive[2] == 1.0
    assert normalize_relevance(rel, 0.25, False, "abs")[0] == 1.0
    ranks = normalize_relevance(torch.randn(40, 25), scaling="quantile")
    assert ranks.min() == 0 and ranks.max() == 1
    assert ranks.mean() == pytest.approx(0.5, abs=1e-3)  # uniform, unlike the top-K mean's
    assert torch.equal(
        rank_fraction(torch.tensor([3.0, 1.0, 1.0, 0.0])), torch.tensor([1.0, 1 / 3, 1 / 3, 0.0])
    )
    scaled = normalize_relevance(rel * 1e3, scaling="quantile", sign="positive")
    assert torch.equal(scaled, normalize_relevance(rel, scaling="quantile", sign="positive"))


def test_the_permuted_control_keeps_the_strengths_and_moves_them() -> None:
    maps = {"a": torch.rand(30, 20), "b": torch.rand(50)}
    shuffled = permuted_maps(maps, seed=3)
    for name, value in maps.items():
        assert torch.equal(shuffled[name].flatten().sort().values, value.flatten().sort().values)
        assert not torch.equal(shuffled[name], value)
    assert all(torch.equal(shuffled[n], permuted_maps(maps, seed=3)[n]) for n in maps)


def test_strength_scales_the_gate() -> None:
    importance = torch.tensor([0.0, 0.5, 1.0])
    assert torch.equal(keep_factor(importance, torch.float32, 0.5), torch.tensor([1.0, 0.75, 0.5]))
    assert torch.equal(keep_factor(importance, torch.float32, 0.0), torch.ones(3))


def test_task_map_is_the_mean_and_history_keeps_the_max() -> None:
    acc = MapAccumulator(top_fraction=1.0, log_scale=False)
    acc.add({"w": torch.tensor([1.0, 0.0])})
    acc.add({"w": torch.tensor([0.0, 2.0])})
    assert torch.allclose(acc.mean()["w"], torch.tensor([0.5 / 0.5, 1.0 / 1.0]) * 0.5 * 2 / 2)
    merged = historical_max({"w": torch.tensor([0.2, 0.9])}, {"w": torch.tensor([0.7, -0.3])})
    assert torch.equal(merged["w"], torch.tensor([0.7, 0.9]))


def test_overlap_of_identical_and_disjoint_sets() -> None:
    a = torch.arange(100.0)
    assert overlap({"w": a}, {"w": a}, 0.1)["overall"] == 1.0
    assert overlap({"w": a}, {"w": -a}, 0.1)["w"] == 0.0
    assert jaccard(top_set(a, 0.2), top_set(a.flip(0), 0.2)) == 0.0
    assert random_jaccard(0.1) == pytest.approx(0.1 / 1.9)


def _gated_steps(optimizer_cls: Any, importance: float, steps: int = 3) -> torch.Tensor:
    """Train one weight under a constant gate; return the change from the start."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(6, 6))
    start = weight.detach().clone()
    opt = optimizer_cls([weight], lr=0.1, weight_decay=0.1)
    keep = keep_factor(torch.full_like(weight, importance), weight.dtype)
    for step in range(steps):
        loss = (weight * torch.randn(6, 6, generator=torch.Generator().manual_seed(step))).sum()
        loss.backward()
        before = weight.detach().clone()
        opt.step()
        with torch.no_grad():
            gate_update_(weight, before, keep)
        opt.zero_grad()
    return weight.detach() - start


@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_full_importance_freezes_a_weight(optimizer_cls: Any) -> None:
    assert torch.equal(_gated_steps(optimizer_cls, 1.0), torch.zeros(6, 6))


def _step_after_warmup(optimizer_cls: Any, keep_value: float) -> torch.Tensor:
    """One gated step after two ungated ones that build the optimizer's state."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(5, 5))
    extra = {"momentum": 0.9} if optimizer_cls is torch.optim.SGD else {}
    opt = optimizer_cls([weight], lr=0.1, weight_decay=0.1, **extra)
    for _ in range(2):
        weight.sum().backward()
        opt.step()
        opt.zero_grad()
    before = weight.detach().clone()
    (weight**2).sum().backward()
    opt.step()
    with torch.no_grad():
        gate_update_(weight, before, torch.full_like(weight, keep_value))
    return weight.detach() - before


@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_half_importance_halves_the_step_under_the_same_optimizer_state(optimizer_cls: Any) -> None:
    full = _step_after_warmup(optimizer_cls, 1.0)
    assert full.abs().min() > 0
    assert torch.allclose(_step_after_warmup(optimizer_cls, 0.5), 0.5 * full, atol=1e-7)


def test_gradient_gating_under_adam_does_not_halve_the_step() -> None:
    """Why the update is gated by default: Adam's normalization cancels a constant grad scale."""
    full = _adam_first_step(1.0)
    assert torch.allclose(_adam_first_step(0.5), full, rtol=1e-3)


def _adam_first_step(grad_scale: float) -> torch.Tensor:
    weight = nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.0)
    (weight * torch.tensor([1.0, -2.0, 3.0, 0.5]) * grad_scale).sum().backward()
    opt.step()
    return weight.detach() - 1.0


def _run(model_dir: Path, out: Path, method: dict[str, Any], **extra: Any) -> dict[str, Any]:
    raw = tiny_run_config(model_dir, method=method, **extra)
    cfg = validate_config(raw)
    return Runner(cfg, out, Console(quiet=True), progress=False).run().to_json()


def test_zero_importance_reproduces_seq_ft(tiny_model_dir: Path, tmp_path: Path) -> None:
    class ZeroMaps(AttributionGate):
        name = "attribution_gate"

        def on_task_end(self, ctx: Any) -> None:
            super().on_task_end(ctx)
            self.importance = {n: torch.zeros_like(p) for n, p in ctx.task.model.named_parameters()}

    method = ZeroMaps(AttributionGateConfig(max_samples=4))
    cfg = validate_config(tiny_run_config(tiny_model_dir, method={"name": "seq_ft"}))
    gated = Runner(cfg, tmp_path / "g", Console(quiet=True), progress=False, method=method).run()
    plain = _run(tiny_model_dir, tmp_path / "p", {"name": "seq_ft"})
    assert gated.to_json()["accuracy_matrix"] == plain["accuracy_matrix"]
    from safetensors.torch import load_file

    ckpt = sorted((tmp_path / "g" / "checkpoints").iterdir())[-1]
    ref = sorted((tmp_path / "p" / "checkpoints").iterdir())[-1]
    a, b = load_file(str(ckpt / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_full_importance_freezes_the_model_on_later_tasks(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    class OneMaps(AttributionGate):
        name = "attribution_gate"

        def on_task_end(self, ctx: Any) -> None:
            super().on_task_end(ctx)
            self.importance = {n: torch.ones_like(p) for n, p in ctx.task.model.named_parameters()}

    method = OneMaps(AttributionGateConfig(max_samples=4))
    cfg = validate_config(tiny_run_config(tiny_model_dir, method={"name": "seq_ft"}))
    Runner(cfg, tmp_path / "g", Console(quiet=True), progress=False, method=method).run()
    from safetensors.torch import load_file

    first, second = sorted((tmp_path / "g" / "checkpoints").iterdir())
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    mapped = set(method.importance)
    assert mapped and all(torch.equal(a[k], b[k]) for k in a if k in mapped)


def _own_predictions(model: nn.Module, n: int) -> list[dict[str, list[int]]]:
    """Examples whose completions are the model's own greedy next tokens: all answered right."""
    feats = []
    for row in range(n):
        ids = torch.randint(5, 40, (1, 6), generator=torch.Generator().manual_seed(row))
        for _ in range(4):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        seq = ids[0].tolist()
        feats.append({"input_ids": seq, "labels": [-100] * 6 + seq[6:]})
    return feats


def test_task_end_maps_correct_samples_into_half_precision(tmp_path: Path) -> None:
    from forgetless.contract.method import RunInfo, TaskContext, TaskEndContext
    from forgetless.contract.plan import TrainStats
    from forgetless.eval.generation import EvalResult
    from forgetless.tasks.base import Example, Task

    model = _tiny("qwen2")
    feats = _own_predictions(model, 3)
    bad = 5 if feats[0]["input_ids"][-1] != 5 else 6  # not the model's prediction
    wrong = {
        "input_ids": [*feats[0]["input_ids"][:-1], bad],
        "labels": [*feats[0]["labels"][:-1], bad],
    }
    tokenizer = build_char_tokenizer()
    task = Task("t", [Example("a", "b")], [Example("a", "b")])
    run = RunInfo(seed=0, out_dir=tmp_path, task_names=["t"], probe_names=[], finetune_mode="full")
    ctx = TaskContext(run, 1, task, model, tokenizer, [*feats, wrong], [], torch.device("cpu"))
    method = AttributionGate(AttributionGateConfig(max_samples=10))
    stats = TrainStats()
    method.on_task_end(TaskEndContext(ctx, {"t": EvalResult("t", 1.0, [True], ["b"])}, stats))
    summary = stats.details["attribution"]
    assert summary["samples_scored"] == 4 and summary["samples_correct"] == 3
    assert set(method.importance) == {n for n, _ in model.named_parameters()}
    flat = torch.cat([m.float().flatten() for m in method.importance.values()])
    assert all(m.dtype == torch.float16 for m in method.importance.values())
    assert flat.min() >= 0 and flat.max() <= 1 and 0 < float(flat.mean()) < 1


def test_lora_needs_the_carry_regime(tiny_model_dir: Path, tmp_path: Path) -> None:
    from forgetless.errors import ConfigError

    with pytest.raises(ConfigError, match="carry"):
        _run(
            tiny_model_dir,
            tmp_path / "r",
            {"name": "attribution_gate"},
            finetune={"mode": "lora", "lora": {"r": 2, "regime": "per_task"}},
        )


def test_the_permuted_control_gates_with_the_same_strengths_elsewhere() -> None:
    model = nn.Linear(6, 4)
    gate = AttributionGate(AttributionGateConfig(control="permuted", strength=0.5))
    gate.importance = {"weight": torch.rand(4, 6), "bias": torch.rand(4)}
    factors = {name: keep for name, _, keep in gate._gate_factors(model, seed=1)}
    for name, value in gate.importance.items():
        expected = (1 - 0.5 * value).flatten().sort().values
        assert torch.allclose(factors[name].flatten().sort().values, expected)
        assert not torch.allclose(factors[name], 1 - 0.5 * value)
    plain = AttributionGate(AttributionGateConfig(strength=0.5))
    plain.importance = gate.importance
    for name, _, keep in plain._gate_factors(model, seed=1):
        assert torch.allclose(keep, 1 - 0.5 * gate.importance[name])
