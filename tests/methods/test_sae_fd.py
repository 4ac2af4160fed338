"""SAE-FD: the two loss terms, the adaptive λ, compact anchors, state, and tiny LoRA runs."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from transformers import AutoModelForCausalLM

from forgetless.config.loading import validate_config
from forgetless.config.schema import ModelConfig
from forgetless.contract.method import RunInfo, StepContext, TaskContext
from forgetless.core.storage import load_method_state, save_method_state
from forgetless.engine.loop import StepLoop, causal_lm_loss
from forgetless.errors import ConfigError
from forgetless.methods.sae_fd import (
    SAEFD,
    AnchorBuffer,
    SAEFDConfig,
    active_magnitude_loss,
    cosine_loss,
    distill_share,
    ema_lambda,
    feature_distillation,
    target_lambda,
)
from forgetless.models.loading import load_tokenizer
from forgetless.sae import GatedSAE, GatedSAEConfig, encode, load_sae, save_sae
from forgetless.sae.activations import MLPTap, last_mlp, token_outputs
from forgetless.sae.train import input_scale
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import collate, completion_window, encode_example
from forgetless.training.export import checkpoint_model, load_run
from forgetless.training.runner import Runner

TINY_SAE = {"steps": 20, "n_per_task": 4, "batch_size": 256, "expansion": 4}
TRAIN = {"steps": 4, "batch_size": 8, "lr": 1e-3, "max_length": 32}
LORA = {"mode": "lora", "lora": {"r": 2}}


def run(model_dir: Path, out: Path, method: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    raw = tiny_run_config(model_dir, method=method, train=TRAIN, **overrides)
    cfg = validate_config(raw)
    return Runner(cfg, out, Console(quiet=True), progress=False).run().to_json()


# --- the loss terms ------------------------------------------------------------------------------


def test_cosine_loss_is_zero_for_identical_features_and_scale_invariant() -> None:
    f, g = torch.randn(6, 40), torch.randn(6, 40)
    assert cosine_loss(f, f.clone()).item() == pytest.approx(0.0, abs=1e-6)
    assert cosine_loss(f, 3.7 * f).item() == pytest.approx(0.0, abs=1e-6)
    base = cosine_loss(f, g).item()
    assert base > 0.5
    assert cosine_loss(5.0 * f, g).item() == pytest.approx(base, rel=1e-5)
    assert cosine_loss(f, 0.01 * g).item() == pytest.approx(base, rel=1e-5)
    assert cosine_loss(f, -f).item() == pytest.approx(2.0, abs=1e-6)


def test_magnitude_loss_ignores_features_inactive_in_the_anchor() -> None:
    f_anchor = torch.relu(torch.randn(5, 30))  # about half the features active
    active = f_anchor > 0
    current = torch.randn(5, 30, requires_grad=True)
    loss = active_magnitude_loss(current, f_anchor)
    expected = ((current - f_anchor)[active] ** 2).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    assert current.grad is not None
    assert bool((current.grad[~active] == 0).all()), "exactly zero off the anchor's support"
    assert bool((current.grad[active] != 0).all())
    # moving an anchor-inactive feature anywhere leaves the loss unchanged
    moved = current.detach().clone()
    moved[~active] += 100.0
    assert active_magnitude_loss(moved, f_anchor).item() == pytest.approx(loss.item(), rel=1e-6)
    none = active_magnitude_loss(current, torch.zeros(5, 30))
    assert none.item() == 0.0 and none.requires_grad


def _sae(d: int = 8, width: int = 64, seed: int = 0) -> GatedSAE:
    return GatedSAE(GatedSAEConfig(d_in=d, d_sae=width), seed=seed)


def test_magnitude_loss_pulls_a_feature_whose_gate_closed_back_open() -> None:
    sae = _sae()
    for p in sae.parameters():
        p.requires_grad_(False)
    h_anchor = torch.randn(1, 8)
    anchor = encode(sae, h_anchor)
    feature = int(anchor.f[0].argmax())
    direction = sae.W_gate[feature] / sae.W_gate[feature].norm()
    # move the current activation against that feature's direction until its gate is closed
    shift = (float(anchor.pi_gate[0, feature]) + 0.5) / float(sae.W_gate[feature].norm())
    h = (h_anchor - shift * direction).requires_grad_()
    now = encode(sae, h.detach())
    assert float(now.pi_gate[0, feature]) < 0 and float(now.f[0, feature]) == 0.0
    parts = feature_distillation(sae, h, h_anchor, "mag", "sae")
    parts.total.backward()
    assert h.grad is not None
    step = -h.grad[0] / h.grad[0].norm()
    assert float(step @ direction) > 0, "the gradient step moves back along the feature direction"
    # the gated f would give no gradient here at all
    h2 = h.detach().clone().requires_grad_()
    gated = active_magnitude_loss(encode(sae, h2).f[:, feature], anchor.f[:, feature])
    gated.backward()
    assert h2.grad is not None and float(h2.grad.abs().sum()) == 0.0


def test_terms_and_spaces_of_the_ablations() -> None:
    sae = _sae()
    h, h_anchor = torch.randn(10, 8), torch.randn(10, 8)
    both = feature_distillation(sae, h, h_anchor, "cos+mag", "sae")
    cos = feature_distillation(sae, h, h_anchor, "cos", "sae")
    mag = feature_distillation(sae, h, h_anchor, "mag", "sae")
    assert both.total.item() == pytest.approx(float(both.l_cos + both.l_mag), rel=1e-6)
    assert cos.total.item() == pytest.approx(float(both.l_cos), rel=1e-6)
    assert mag.total.item() == pytest.approx(float(both.l_mag), rel=1e-6)
    assert not both.l_cos.requires_grad and not both.l_mag.requires_grad
    raw = feature_distillation(None, h, h_anchor, "cos+mag", "dense_mse")
    assert raw.total.item() == pytest.approx(((h - h_anchor) ** 2).mean().item(), rel=1e-6)
    dense = feature_distillation(None, h, h_anchor, "cos+mag", "dense")  # the same form on h
    cos = (1 - torch.nn.functional.cosine_similarity(h, h_anchor, dim=-1)).mean()
    assert float(dense.l_cos) == pytest.approx(cos.item(), rel=1e-5)
    assert float(dense.l_mag) == pytest.approx(((h - h_anchor) ** 2).mean().item(), rel=1e-6)
    assert dense.total.item() == pytest.approx(float(dense.l_cos + dense.l_mag), rel=1e-6)
    assert feature_distillation(None, h, h, "cos+mag", "dense").total.item() == pytest.approx(
        0, abs=1e-6
    )


# --- the adaptive λ ----------------------------------------------------------------------------


def test_adaptive_lambda_drives_the_share_toward_rho() -> None:
    """A synthetic pair: L_task noisy around 2, and L_FD that shrinks as λ grows (the
    regulariser works), so λ feeds back into the share it steers."""
    rng = random.Random(0)
    lam, shares = 1.0, []
    for _ in range(400):
        task = 2.0 + rng.uniform(-0.2, 0.2)
        fd = 0.2 / (1.0 + 0.1 * lam)
        lam = ema_lambda(lam, task, fd, rho=0.15, rate=0.05, lam_min=0.2, lam_max=10.0)
        shares.append(distill_share(lam, 0.2 / (1.0 + 0.1 * lam), task))
    assert abs(shares[0] - 0.15) > 0.05, "starts away from the target"
    tail = shares[-100:]
    assert abs(sum(tail) / len(tail) - 0.15) < 0.01
    assert 0.2 <= lam <= 10.0


def test_lambda_target_is_clipped_and_guarded() -> None:
    assert target_lambda(2.0, 0.5, 0.15, 0.2, 10.0) == pytest.approx(0.15 / 0.85 * 4.0)
    assert target_lambda(2.0, 1e-9, 0.15, 0.2, 10.0) == 10.0, "clipped above"
    assert target_lambda(0.01, 10.0, 0.15, 0.2, 10.0) == 0.2, "clipped below"
    for fd in (0.0, 1e-30, float("nan")):
        assert target_lambda(2.0, fd, 0.15, 0.2, 10.0) == 10.0, "L_FD ≈ 0 is guarded"
    assert target_lambda(0.0, 0.0, 0.15, 0.2, 10.0) == 0.2
    lam = 1.0
    for _ in range(200):  # many steps at L_FD = 0: λ rises to the cap and stays finite
        lam = ema_lambda(lam, 2.0, 0.0, 0.15, 0.05, 0.2, 10.0)
    assert 9.99 < lam <= 10.0


# --- anchors ---------------------------------------------------------------------------------


def _context(model_dir: Path, model: Any, n: int = 16) -> TaskContext:
    tokenizer = load_tokenizer(str(model_dir), ModelConfig())
    task = build_builtin_task("reverse", n_train=n, n_eval=2, seed=0)
    features = [encode_example(tokenizer, e, 32) for e in task.train]
    info = RunInfo(
        seed=0, out_dir=model_dir, task_names=["reverse"], probe_names=[], finetune_mode="full"
    )
    return TaskContext(info, 1, task, model, tokenizer, features, [], torch.device("cpu"))


def test_anchors_take_half_the_bytes_of_float32_and_keep_the_loss(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    ctx = _context(tiny_model_dir, model)
    methods = {
        dtype: SAEFD(SAEFDConfig(anchor_samples=12, anchor_dtype=dtype))
        for dtype in ("float16", "float32")
    }
    added = {dtype: m.capture_anchors(ctx) for dtype, m in methods.items()}
    b16, b32 = methods["float16"].buffer, methods["float32"].buffer
    assert b16.h.dtype == torch.float16 and b32.h.dtype == torch.float32
    assert b16.h.nbytes * 2 == b32.h.nbytes, "the MLP outputs take exactly half"
    assert torch.equal(b16.ids, b32.ids) and b16.ids.dtype == torch.int16
    d = model.config.hidden_size
    assert added["float16"]["bytes_per_token"] == 2 * d + 2
    assert added["float32"]["bytes_per_token"] == 4 * d + 2
    assert added["float16"]["tokens"] == int(b16.lengths.sum()) == b16.h.size(0)
    # the model drifts (as a later task would move it); the loss from either buffer agrees
    with torch.no_grad():
        for p in model.model.layers[-1].mlp.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.std())
    rows = list(range(12))
    inputs, t16 = b16.gather(rows, 0, ctx.device)
    _, t32 = b32.gather(rows, 0, ctx.device)
    tap = MLPTap()
    handle = tap.register(model)
    with torch.no_grad():
        h = token_outputs(tap, model, inputs)
    handle.remove()
    sae = GatedSAE(GatedSAEConfig(d_in=d, d_sae=8 * d, input_scale=input_scale(t32)), seed=0)
    for terms, space in (("cos+mag", "sae"), ("cos", "sae"), ("mag", "sae"), ("cos", "dense")):
        l16 = feature_distillation(sae, h, t16.float(), terms, space).total.item()
        l32 = feature_distillation(sae, h, t32, terms, space).total.item()
        assert l32 > 0 and abs(l16 - l32) / l32 < 0.01, (terms, space, l16, l32)


def test_anchor_draws_follow_the_fraction_and_the_seed(tiny_model_dir: Path) -> None:
    method = SAEFD(SAEFDConfig(anchor_samples=10, anchor_batch_fraction=0.25))
    method.capture_anchors(
        _context(tiny_model_dir, AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)))
    )
    task = SimpleNamespace(task_index=2, run=SimpleNamespace(seed=0))
    step = SimpleNamespace(task=task, step=3)
    first = method._draw(8, step)  # type: ignore[arg-type]
    assert len(first) == 2 and len(set(first)) == 2
    again = SAEFD(method.config)
    again.buffer = method.buffer
    assert again._draw(8, step) == first, "the same (run, task, step, micro-batch) draws the same"  # type: ignore[arg-type]
    assert len(method._draw(64, SimpleNamespace(task=task, step=4))) == 16  # type: ignore[arg-type]


def _third_task_step(model_dir: Path) -> tuple[Any, TaskContext, GatedSAE, StepContext]:
    """A tiny model, its task context, a random SAE and the first step of a third task."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    ctx = _context(model_dir, model)
    d = model.config.hidden_size
    sae = GatedSAE(GatedSAEConfig(d_in=d, d_sae=4 * d), seed=0)
    return (
        model,
        ctx,
        sae,
        StepContext(task=dataclasses.replace(ctx, task_index=2), step=0, total_steps=1),
    )


def test_anchors_folded_into_the_task_batch_give_the_separate_forwards_loss(
    tiny_model_dir: Path,
) -> None:
    """One forward over task + anchor rows = the task forward + a forward on the anchors alone:
    the same cross-entropy (anchor rows carry no label), the same L_FD and gradient."""
    model, ctx, sae, step = _third_task_step(tiny_model_dir)
    feats = ctx.train_features[:8]
    results = {}
    for forward in ("fold", "separate"):
        method = SAEFD(SAEFDConfig(anchor_samples=12, anchor_forward=forward))
        method.capture_anchors(ctx)
        method.sae = sae
        handles = method.register_hooks(step.task)
        batch = collate(method.transform_batch(feats, step), 0)
        outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        term = method.loss_terms(batch, outputs, step)["sae_fd"]
        model.zero_grad()
        (causal_lm_loss(outputs.logits, batch["labels"]) + term).backward()
        grad = model.model.layers[0].mlp.up_proj.weight.grad.clone()
        for handle in handles:
            handle.remove()
        results[forward] = (batch["input_ids"].size(0), term.item(), method.lam, grad)
    (rows_f, fd_f, lam_f, grad_f), (rows_s, fd_s, lam_s, grad_s) = results.values()
    assert (rows_f, rows_s) == (8 + 2, 8), "a quarter of the batch joins it when folded"
    assert fd_f == pytest.approx(fd_s, rel=1e-5) and fd_f > 0
    assert lam_f == pytest.approx(lam_s, rel=1e-6)
    assert torch.allclose(grad_f, grad_s, rtol=1e-4, atol=1e-7)


def test_the_loop_gives_the_completion_window_and_the_term_and_lambda_are_unchanged(
    tiny_model_dir: Path,
) -> None:
    """Folded anchors carry no labels, so the completion window is the task rows'; the term and
    the adaptive λ (read from the task rows' loss) are those of the full logits."""
    model, ctx, sae, step = _third_task_step(tiny_model_dir)
    values = {}
    for keep in ("full", "window"):
        method = SAEFD(SAEFDConfig(anchor_samples=12))
        method.capture_anchors(ctx)
        method.sae = sae
        assert StepLoop(model, method, ctx, 0)._windowed(None)
        handles = method.register_hooks(step.task)
        batch = collate(method.transform_batch(ctx.train_features[:8], step), 0)
        window = completion_window(batch["labels"])
        assert window < batch["input_ids"].size(1)
        extra = {"logits_to_keep": window} if keep == "window" else {}
        with torch.no_grad():
            outputs = model(batch["input_ids"], attention_mask=batch["attention_mask"], **extra)
            values[keep] = (method.loss_terms(batch, outputs, step)["sae_fd"].item(), method.lam)
        for handle in handles:
            handle.remove()
    assert values["window"] == pytest.approx(values["full"], rel=1e-6)


def test_skip_first_leaves_each_anchors_first_token_out_of_the_loss(
    tiny_model_dir: Path,
) -> None:
    """With ``sae.skip_first`` the first token's stored output cannot move L_FD; else it does."""
    model, ctx, sae, step = _third_task_step(tiny_model_dir)
    feats = ctx.train_features[:8]

    def term(skip_first: bool, forward: str, first_scale: float) -> float:
        method = SAEFD(
            SAEFDConfig(anchor_samples=12, anchor_forward=forward, sae={"skip_first": skip_first})
        )
        method.capture_anchors(ctx)
        method.buffer.h[method.buffer.starts()] *= first_scale
        method.sae = sae
        handles = method.register_hooks(step.task)
        batch = collate(method.transform_batch(feats, step), 0)
        with torch.no_grad():
            outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            value = method.loss_terms(batch, outputs, step)["sae_fd"].item()
        for handle in handles:
            handle.remove()
        return value

    for forward in ("fold", "separate"):
        assert term(True, forward, 50.0) == pytest.approx(term(True, forward, 1.0), rel=1e-6)
        assert term(False, forward, 50.0) > 1.01 * term(False, forward, 1.0)


# --- runs ------------------------------------------------------------------------------------


def test_two_task_lora_run_logs_lambda_and_round_trips_its_state(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    method = {"name": "sae_fd", "anchor_samples": 8, "sae": TINY_SAE}
    first = run(tiny_model_dir, tmp_path / "a", method, finetune=LORA)
    t1, t2 = first["per_task"]
    assert t1["loss_terms"]["sae_fd"] == 0.0, "no anchors while training the first task"
    assert t2["loss_terms"]["sae_fd"] > 0.0
    fd = t2["details"]["sae_fd"]
    assert len(fd["lambda"]) == TRAIN["steps"] == len(fd["l_cos"]) == len(fd["l_mag"])
    assert all(0.2 <= lam <= 10.0 for lam in fd["lambda"])
    assert fd["lambda"][0] == pytest.approx(10.0), "a task starts at lam_max (lam_start: max)"
    assert fd["l_cos"][-1] > 0 and fd["l_mag"][-1] > 0
    assert fd["sae"]["trained"] is True and fd["sae"]["sae"]["d_sae"] == 4 * 32
    sources = set(fd["sae"]["sources"])  # the base's general data, never the sequence's tasks
    assert "copy" in sources and not sources & {"reverse", "cipher"}
    assert fd["anchors"]["samples"] == 8 and fd["buffer"]["samples"] == 16
    assert list((tmp_path / "cache" / "sae").iterdir()), "cached in the shared folder"
    # state: anchors of both tasks (float16) and λ, through safetensors + JSON
    state = load_method_state(tmp_path / "a" / "checkpoints" / "task-02-cipher")
    assert state["lam"] == pytest.approx(fd["lambda_end"])
    assert state["anchors"]["h"].dtype == torch.float16
    assert state["anchors"]["tasks"].tolist() == [1] * 8 + [2] * 8
    restored = SAEFD(SAEFDConfig(anchor_samples=8))
    restored.load_state_dict(state)
    save_method_state(tmp_path, restored.state_dict())
    again = load_method_state(tmp_path)
    for key, value in state["anchors"].items():
        assert torch.equal(again["anchors"][key], value)
    # a second run on the same base finds the cached SAE and repeats the first exactly
    second = run(tiny_model_dir, tmp_path / "b", method, finetune=LORA)
    assert second["per_task"][1]["details"]["sae_fd"]["sae"]["trained"] is False
    assert second["accuracy_matrix"] == first["accuracy_matrix"]
    assert second["per_task"][1]["loss_terms"] == t2["loss_terms"]


def test_fixed_lambda_dense_ablation_needs_no_sae(tiny_model_dir: Path, tmp_path: Path) -> None:
    method = {"name": "sae_fd", "anchor_samples": 8, "space": "dense", "adaptive": False,
              "sae_cache": "run"}  # fmt: skip
    result = run(tiny_model_dir, tmp_path, method)
    fd = result["per_task"][1]["details"]["sae_fd"]
    assert fd["lambda"] == [1.0] * TRAIN["steps"]
    assert fd["l_fd"][-1] > 0 and "sae" not in fd
    assert not (tmp_path / "sae").exists()


def test_sae_from_a_path(tiny_model_dir: Path, tmp_path: Path) -> None:
    save_sae(_sae(d=32, width=64), tmp_path / "given")
    method = {"name": "sae_fd", "anchor_samples": 8, "sae_path": str(tmp_path / "given")}
    fd = run(tiny_model_dir, tmp_path / "run", method)["per_task"][1]["details"]["sae_fd"]
    assert fd["sae"]["trained"] is False and fd["sae"]["path"] == str(tmp_path / "given")
    method["sae_path"] = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="sae_path"):
        run(tiny_model_dir, tmp_path / "bad", method)


def _feature_loss_on_first_task_anchors(out: Path, anchors_from: Path, sae: GatedSAE) -> float:
    """L_FD of the run's final model on the first task's anchors (stored by the SAE-FD run)."""
    cfg, _ = load_run(out)
    model, _ = checkpoint_model(cfg, out, [t.display_name for t in cfg.tasks], len(cfg.tasks))
    buffer = AnchorBuffer.from_state(
        load_method_state(anchors_from / "checkpoints" / "task-02-cipher")["anchors"]
    )
    rows = [i for i, task in enumerate(buffer.tasks.tolist()) if task == 1]
    inputs, stored = buffer.gather(rows, 0, torch.device("cpu"))
    tap = MLPTap()
    handle = last_mlp(model).register_forward_hook(tap)
    with torch.no_grad():
        now = token_outputs(tap, model, inputs)
    handle.remove()
    return float(feature_distillation(sae, now, stored.float(), "cos+mag", "sae").total)


def test_sae_fd_keeps_the_first_tasks_features_closer_than_seq_ft(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paper's mechanism on a model: after the second task, the first task's anchors read
    through the SAE lie closer to their stored features under SAE-FD than under SeqFT trained
    the same way (same seed, steps and rate), while its second task's loss stays SeqFT's: the
    features are kept, not the learning stopped."""
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    train = {**TRAIN, "steps": 12, "lr": 3e-3}
    method = {"name": "sae_fd", "anchor_samples": 8, "sae": TINY_SAE}
    raw = tiny_run_config(tiny_model_dir, method=method, train=train)
    fd = Runner(validate_config(raw), tmp_path / "fd", Console(quiet=True), progress=False).run()
    raw = tiny_run_config(tiny_model_dir, method={"name": "seq_ft"}, train=train)
    sft = Runner(validate_config(raw), tmp_path / "sft", Console(quiet=True), progress=False).run()
    second = [run.to_json()["per_task"][1]["loss_terms"]["task"] for run in (fd, sft)]
    assert second[0] == pytest.approx(second[1], rel=0.1), "it learns the second task as SeqFT does"
    sae = load_sae(next((tmp_path / "cache" / "sae").iterdir()))
    kept = _feature_loss_on_first_task_anchors(tmp_path / "fd", tmp_path / "fd", sae)
    lost = _feature_loss_on_first_task_anchors(tmp_path / "sft", tmp_path / "fd", sae)
    assert lost > 0
    assert kept < 0.5 * lost, (kept, lost)
