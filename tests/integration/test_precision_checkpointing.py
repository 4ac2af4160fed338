"""Large-model settings of the step loop: gradient checkpointing gives the gradients of a run
without it (full and LoRA), fp16 autocast trains with a loss scaler that drops an overflowing
step and resumes its state, sdpa attention by default (eager where a model has none), and the
runtime settings said at start and kept in results.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, tiny_run_config
from rich.console import Console
from transformers import Qwen2ForCausalLM

from forgetless.config.loading import validate_config
from forgetless.config.schema import FinetuneConfig, ModelConfig, method_config
from forgetless.contract.method import create_method
from forgetless.contract.plan import TrainPlan
from forgetless.engine.loop import StepLoop, causal_lm_loss
from forgetless.engine.precision import checkpointing
from forgetless.engine.step_checkpoint import META, StepCheckpointer
from forgetless.models.finetuner import Finetuner
from forgetless.models.loading import load_model
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.sae.activations import MLPTap
from forgetless.testing import task_context
from forgetless.training.results import Results
from forgetless.training.runner import Runner
from forgetless.training.startup import start_up


def tiny(mode: str = "full") -> torch.nn.Module:
    model = build_tiny_model(TINY, vocab_size=len(build_char_tokenizer()), seed=0)
    finetuner = Finetuner(model, FinetuneConfig(mode=mode))  # type: ignore[call-arg]
    finetuner.begin_task(1)
    return finetuner.model


def loop_for(model: torch.nn.Module) -> StepLoop:
    ctx = task_context(model, ["reverse", "cipher"], n_train=16)
    return StepLoop(model, create_method(method_config("seq_ft")), ctx, pad_id=0)


def first_step_gradients(mode: str, checkpointed: bool) -> tuple[dict[str, torch.Tensor], int]:
    """The gradients of one step's backward pass (caught by hooks before the update), and how
    often a query projection ran (twice under checkpointing: forward and recompute)."""
    model = tiny(mode)
    grads: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.register_hook(lambda g, n=name: grads.setdefault(n, g.detach().clone()))
    runs = [0]
    query = next(m for n, m in model.named_modules() if n.endswith("layers.1.self_attn.q_proj"))
    query.register_forward_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    loop = loop_for(model)
    plan = TrainPlan(steps=1, batch_size=4, lr=1e-3, seed=0, gradient_checkpointing=checkpointed)
    loop.run(loop.ctx.train_features, plan)
    assert not model.is_activation_checkpointing, "checkpointing is left on after the loop"
    return grads, runs[0]


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_checkpointed_gradients_equal_plain_ones(mode: str) -> None:
    plain, plain_runs = first_step_gradients(mode, checkpointed=False)
    checkpointed, recomputed_runs = first_step_gradients(mode, checkpointed=True)
    assert (plain_runs, recomputed_runs) == (1, 2), "the layer was not recomputed"
    assert plain.keys() == checkpointed.keys() and plain
    if mode == "lora":
        assert all("lora_" in name for name in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("recording", [False, True])
def test_sae_fd_tap_under_checkpointing(recording: bool) -> None:
    """SAE-FD's MLP tap, stopping the forward at the last MLP (``anchor_forward: separate``)
    or recording a full forward (``fold``): the recompute in the backward pass leaves it idle
    and the gradients through the tapped outputs are the plain ones."""
    model = tiny()
    model.train()
    tap = MLPTap()
    tap.register(model)
    ids = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def gradients(on: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with checkpointing(model, on):
            if recording:
                tap.recording = True
                model(input_ids=ids, attention_mask=mask, use_cache=False)
                h = tap.take()
            else:
                h = tap.run(model, ids, mask)
            h.pow(2).mean().backward()
        assert tap.output is None and not (tap.armed or tap.recording)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys() and plain
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-5, rtol=0, msg=name)


def test_fp16_autocast_trains() -> None:
    model = tiny()
    loop = loop_for(model)
    plan = TrainPlan(steps=30, batch_size=8, lr=3e-3, seed=0, fp16=True)
    stats = loop.run(loop.ctx.train_features, plan)
    assert sum(stats.losses[-5:]) / 5 < 0.8 * sum(stats.losses[:5]) / 5
    assert stats.details["grad_scaler"]["skipped_steps"] < 5
    assert stats.skipped_steps == 0
    assert all(p.dtype == torch.float32 for p in model.parameters()), "weights stay float32"


def overflow_at_first_step(batch: Any, outputs: Any, sctx: Any) -> torch.Tensor:
    """The task loss, blown up at step 0: finite in float32, its float16 gradients are not."""
    loss = causal_lm_loss(outputs.logits, batch["labels"][:, -outputs.logits.shape[1] :])
    return loss * 1e30 if sctx.step == 0 else loss


def test_scaler_drops_an_overflowing_step_and_resumes(tmp_path: Path) -> None:
    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loop = loop_for(model)
    fingerprint = {"test": 1}
    loop.checkpointer = StepCheckpointer(tmp_path / "step", 1, loop.method, fingerprint)
    first = TrainPlan(steps=1, batch_size=4, lr=1e-3, seed=0, fp16=True, on_nonfinite="stop")
    stats = loop.run(loop.ctx.train_features, first, overflow_at_first_step)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "applied"
    assert stats.details["grad_scaler"]["skipped_steps"] == 1 and stats.skipped_steps == 0
    assert stats.details["grad_scaler"]["final_scale"] == 2.0**15  # halved from 2**16
    saved = json.loads((tmp_path / "step" / META).read_text())["progress"]["scaler"]
    assert saved["skipped"] == [0] and saved["state"]["scale"] == 2.0**15

    resumed = loop_for(model)
    resumed.checkpointer = StepCheckpointer(tmp_path / "step", 1, loop.method, fingerprint)
    more = TrainPlan(steps=3, batch_size=4, lr=1e-3, seed=0, fp16=True)
    stats = resumed.run(resumed.ctx.train_features, more, overflow_at_first_step)
    assert stats.details["grad_scaler"]["steps"] == [0], "the saved skip was not restored"
    assert not all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_sdpa_by_default_and_eager_with_a_note(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ModelConfig().attn_implementation == "sdpa"
    assert load_model(str(tiny_model_dir), ModelConfig()).config._attn_implementation == "sdpa"
    monkeypatch.setattr(Qwen2ForCausalLM, "_supports_sdpa", False)
    cfg = validate_config(tiny_run_config(tiny_model_dir))
    model = load_model(str(tiny_model_dir), cfg.model)
    assert model.config._attn_implementation == "eager"
    said: list[str] = []
    start_up(cfg, model, build_char_tokenizer(), [], [], torch.device("cpu"), said.append)
    assert "autocast: off, attention: eager, gradient checkpointing: off" in said
    assert any(line.startswith("note: Qwen2ForCausalLM has no sdpa attention") for line in said)


def test_runtime_said_at_start_and_recorded(tiny_model_dir: Path, tmp_path: Path) -> None:
    train = {"steps": 2, "batch_size": 8, "lr": 1e-3, "max_length": 32}
    raw = tiny_run_config(
        tiny_model_dir,
        train={**train, "autocast": "fp16", "gradient_checkpointing": True},
        tasks=["reverse"],
    )
    console = Console(record=True, width=200)
    Runner(validate_config(raw), tmp_path, console, progress=False).run()
    assert "autocast: fp16 (loss scaled), attention: sdpa, gradient checkpointing: on" in (
        console.export_text().splitlines()
    )
    data = json.loads((tmp_path / "results.json").read_text())
    load = data["runtime"].pop("load_at_start")
    assert load is None or load >= 0
    assert data["runtime"] == {
        "device": "cpu",
        "dtype": "float32",
        "autocast": "fp16",
        "attn_implementation": "sdpa",
        "gradient_checkpointing": True,
        "threads": torch.get_num_threads(),
    }
    assert "grad_scaler" in data["per_task"][0]["details"]
    del data["runtime"]  # a file written before the record: still read
    (tmp_path / "results.json").write_text(json.dumps(data))
    assert Results.read(tmp_path / "results.json").runtime == {}
