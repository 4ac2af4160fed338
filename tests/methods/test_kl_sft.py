"""KL-SFT: the token KL, a lower drift from the base than seq_ft, and a base reference on resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import moved_lora, tiny_run_config
from rich.console import Console
from safetensors.torch import load_file, load_model
from transformers import AutoModelForCausalLM

from forgetless.config.loading import validate_config
from forgetless.config.schema import ModelConfig
from forgetless.contract.method import Capability, StepContext
from forgetless.engine.loop import StepLoop
from forgetless.eval import metrics
from forgetless.eval.generation import completion_logprobs, kl_drift
from forgetless.methods.kl_sft import KLSFT, KLSFTConfig, token_kl
from forgetless.models.loading import load_model_and_tokenizer
from forgetless.tasks.formatting import IGNORE_INDEX, collate, completion_window
from forgetless.testing import task_context
from forgetless.training.runner import Runner, load_tasks


def run(model_dir: Path, out: Path, method: Any, **overrides: Any) -> dict[str, Any]:
    cfg = validate_config(tiny_run_config(model_dir, **overrides))
    return Runner(cfg, out, Console(quiet=True), progress=False, method=method).run().to_json()


def test_token_kl_is_zero_against_itself_and_follows_the_direction() -> None:
    logits, ref = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert token_kl(logits, logits.clone(), mask).item() == 0.0
    lp, lq = logits.log_softmax(-1), ref.log_softmax(-1)
    forward = token_kl(logits, ref, mask, "model_to_base")
    torch.testing.assert_close(forward, metrics.token_kl(lp, lq, mask))
    torch.testing.assert_close(
        token_kl(logits, ref, mask, "base_to_model"), metrics.token_kl(lq, lp, mask)
    )
    assert forward.item() > 0
    empty = token_kl(logits.requires_grad_(), ref, torch.zeros(2, 5, dtype=torch.bool))
    assert empty.item() == 0.0 and empty.requires_grad


def test_penalty_is_zero_while_the_model_is_the_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    method = KLSFT(KLSFTConfig(beta=1.0))
    one_step = {"steps": 1, "batch_size": 8, "lr": 1e-3, "max_length": 32}
    results = run(tiny_model_dir, tmp_path, method, tasks=["reverse"], train=one_step)
    assert results["per_task"][0]["loss_terms"]["kl_sft"] == 0.0
    reference = method.reference.copy  # full fine-tuning: a loaded frozen copy
    assert reference is not None and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())


def _drift_on_task(model_dir: Path, run_dir: Path, cfg: Any) -> float:
    """KL(p_model ‖ p_base) on the task's own training examples, completion tokens only."""
    base, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(model_dir)))
    trained, _ = load_model_and_tokenizer(ModelConfig(name_or_path=str(model_dir)))
    load_model(trained, str(run_dir / "checkpoints/task-01-reverse/model.safetensors"))
    examples = load_tasks(cfg.tasks, cfg)[0].train[:32]
    before = completion_logprobs(base, tokenizer, examples, 32)
    after = completion_logprobs(trained, tokenizer, examples, 32)
    return kl_drift(before, after)[1]


def test_large_beta_keeps_the_model_closer_to_the_base(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    budget = {
        "tasks": ["reverse"],
        "train": {"steps": 8, "batch_size": 8, "lr": 1e-2, "max_length": 32},
    }
    cfg = validate_config(tiny_run_config(tiny_model_dir, **budget))
    run(tiny_model_dir, tmp_path / "seq", None, **budget)
    kl = run(tiny_model_dir, tmp_path / "kl", KLSFT(KLSFTConfig(beta=20.0)), **budget)
    assert kl["per_task"][0]["loss_terms"]["kl_sft"] > 0
    seq_drift = _drift_on_task(tiny_model_dir, tmp_path / "seq", cfg)
    kl_drift_ = _drift_on_task(tiny_model_dir, tmp_path / "kl", cfg)
    assert kl_drift_ < 0.5 * seq_drift, (kl_drift_, seq_drift)


class CrashAt(KLSFT):
    """KL-SFT that dies at a given task and step, as a killed process would."""

    capabilities = KLSFT.capabilities | {Capability.BATCH_TRANSFORM}

    def __init__(self, task: int, step: int) -> None:
        super().__init__(KLSFTConfig(beta=1.0))
        self.where = (task, step)

    def transform_batch(self, features: list[Any], ctx: StepContext) -> list[Any]:
        if (ctx.task.task_index, ctx.step) == self.where:
            raise KeyboardInterrupt("simulated crash")
        return features


@pytest.mark.parametrize("finetune", [{"mode": "full"}, {"mode": "lora", "lora": {"r": 2}}])
def test_resumed_run_uses_the_base_as_reference(
    finetune: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    overrides = {
        "finetune": finetune,
        "train": {"steps": 4, "batch_size": 8, "lr": 1e-2, "max_length": 32},
    }
    full = run(tiny_model_dir, tmp_path / "full", KLSFT(KLSFTConfig(beta=1.0)), **overrides)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_model_dir, tmp_path / "crash", CrashAt(task=2, step=2), **overrides)
    resumed = run(tiny_model_dir, tmp_path / "crash", KLSFT(KLSFTConfig(beta=1.0)), **overrides)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["kl_drift"] == full["kl_drift"]
    assert resumed["per_task"][1]["loss_terms"] == full["per_task"][1]["loss_terms"]
    assert full["per_task"][1]["loss_terms"]["kl_sft"] > 0
    for file in (tmp_path / "full/checkpoints/task-02-cipher").rglob("*.safetensors"):
        a, b = (
            load_file(str(file)),
            load_file(str(tmp_path / "crash" / file.relative_to(tmp_path / "full"))),
        )
        assert all(torch.equal(a[k], b[k]) for k in a), file


def _never_load() -> Any:
    raise AssertionError("under LoRA, KL-SFT must not load a second copy of the base")


def test_under_lora_the_reference_is_the_adapter_free_model(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    lora = moved_lora(tiny_model_dir)
    ctx = task_context(lora, ["reverse"], n_train=4, finetune_mode="lora", lora_regime="carry")
    ctx.run.load_base = _never_load
    method = KLSFT(KLSFTConfig(beta=1.0))
    method.on_task_start(ctx)
    batch = collate(ctx.train_features, ctx.tokenizer.pad_token_id)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    out = lora(**inputs)
    got = method.loss_terms(batch, out, StepContext(ctx, 0, 1))["kl_sft"]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    with torch.no_grad():
        base_logits = base(**inputs).logits
    mask = batch["labels"][:, 1:] != IGNORE_INDEX
    expected = token_kl(out.logits[:, :-1], base_logits[:, :-1], mask)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert got.item() > 1e-4 and lora.training


def test_the_loop_gives_it_the_completion_window_and_the_kl_is_unchanged(
    tiny_model_dir: Path,
) -> None:
    torch.manual_seed(0)
    lora = moved_lora(tiny_model_dir)
    ctx = task_context(lora, ["reverse"], n_train=4, finetune_mode="lora", lora_regime="carry")
    method = KLSFT(KLSFTConfig(beta=1.0))
    method.on_task_start(ctx)
    loop = StepLoop(lora, method, ctx, ctx.tokenizer.pad_token_id)
    assert loop._windowed(None)
    batch = collate(ctx.train_features, ctx.tokenizer.pad_token_id)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    keep = completion_window(batch["labels"])
    assert keep < batch["input_ids"].shape[1]  # the window leaves the prompt's logits out
    step = StepContext(ctx, 0, 1)
    full = method.loss_terms(batch, lora(**inputs), step)["kl_sft"]
    windowed = method.loss_terms(batch, lora(**inputs, logits_to_keep=keep), step)["kl_sft"]
    torch.testing.assert_close(windowed, full, atol=1e-6, rtol=0)
