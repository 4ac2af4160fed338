"""SDFT: the student samples from the prompt alone, a teacher that sees the demonstration scores
the same tokens, and the loss is TRL's SDFTTrainer loss on the same batch."""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from types import MethodType, SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from pydantic import ValidationError
from rich.console import Console
from typer.testing import CliRunner

from forgetless.cli.app import app
from forgetless.config.loading import validate_config
from forgetless.contract.method import StepContext, TaskContext, method_class
from forgetless.engine import loop
from forgetless.integrations.fit import refusal
from forgetless.methods.sdft import SDFT, SDFTConfig, sdft_loss, teacher_example
from forgetless.models.tiny import build_tiny_model
from forgetless.tasks.base import Example
from forgetless.tasks.formatting import IGNORE_INDEX, collate, encode_example, encode_prompt
from forgetless.testing import CHAT_TEMPLATE, TINY, task_context, tiny_run_config
from forgetless.training.runner import Runner


def _model() -> torch.nn.Module:
    return build_tiny_model(TINY, vocab_size=99, seed=0)


def _started(chat: bool = False, **options: Any) -> tuple[SDFT, TaskContext]:
    ctx = task_context(_model(), ["reverse"], n_train=8)
    if chat:
        ctx.tokenizer.chat_template = CHAT_TEMPLATE
        ctx.train_features = [encode_example(ctx.tokenizer, e, 64) for e in ctx.task.train[:8]]
    method = SDFT(SDFTConfig(max_new_tokens=6, **options))
    method.begin_task(ctx)
    return method, ctx


def _sampled(method: SDFT, ctx: TaskContext, step: int = 0) -> list[dict[str, list[int]]]:
    features = [{**f, "index": [i]} for i, f in enumerate(ctx.train_features[:4])]
    return method.transform_batch(features, StepContext(ctx, step, 3))


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


@pytest.mark.parametrize("chat", [False, True])
def test_the_teachers_ids_hold_the_demonstration_and_the_students_do_not(chat: bool) -> None:
    method, ctx = _started(chat)
    student_rows = _sampled(method, ctx)
    for j, (student, teacher) in enumerate(zip(student_rows, method._rows, strict=True)):
        example = ctx.task.train[j]
        demo = ctx.tokenizer(example.completion, add_special_tokens=False)["input_ids"]
        prompt = encode_prompt(ctx.tokenizer, example)
        sample = [t for t in student["labels"] if t != IGNORE_INDEX]
        assert student["input_ids"] == prompt + sample and student["index"] == [j]
        assert not _holds(student["input_ids"], demo)
        assert _holds(teacher["input_ids"][: -len(sample)], demo)
        assert teacher["input_ids"][-len(sample) :] == sample == teacher["labels"][-len(sample) :]
        assert 1 <= len(sample) <= 6


def test_a_chat_demonstration_goes_into_the_last_user_turn() -> None:
    turns = (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    )
    out = teacher_example(Example("q", "a", messages=turns), "{prompt} | {demonstration}")
    assert out.messages is not None and out.messages[0] == turns[0]
    assert out.messages[1] == {"role": "user", "content": "q | a"} and out.prompt == "q | a"


def _trl() -> Any:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    return pytest.importorskip("trl.experimental.sdft.sdft_trainer")


def _trl_trainer(trl: Any, cfg: SDFTConfig) -> Any:
    """An object that runs TRL's own SDFTTrainer loss methods with ``cfg``'s settings."""
    mode = "full_logits" if cfg.top_k is None else "topk_logits"
    args = SimpleNamespace(
        distillation_mode=mode,
        distillation_topk=cfg.top_k,
        distillation_alpha=cfg.alpha,
        distillation_add_tail=cfg.top_k_tail,
        distillation_is_clip=2.0,  # TRL's default: no effect without stale rollout log-probs
    )
    fake = SimpleNamespace(
        args=args,
        temperature=cfg.temperature,
        num_loss_tokens_to_skip=cfg.skip_tokens,
        model_kwarg_keys={"logits_to_keep"},
        accelerator=SimpleNamespace(gather=lambda x: x),
        _log_self_distillation_metric=lambda mode, value: None,
        _get_teacher_context_for_self_distillation=nullcontext,
    )
    cls = trl.SDFTTrainer
    for name in ("_forward_logits", "_compute_teacher_student_logits"):
        setattr(fake, name, MethodType(getattr(cls, name), fake))
    fake.loss = MethodType(cls._compute_self_distillation_loss, fake)
    return fake


CASES = [
    {},
    {"alpha": 0.0},
    {"alpha": 0.5, "temperature": 0.7},
    {"alpha": 0.5, "top_k": 5},
    {"alpha": 1.0, "top_k": 5, "top_k_tail": True},
]


@pytest.mark.parametrize("options", CASES)
def test_the_loss_on_fixed_logits_is_trls(options: dict[str, Any]) -> None:
    trl = _trl()
    cfg = SDFTConfig(**options)
    student = torch.randn(3, 6, 17, requires_grad=True)
    teacher = torch.randn(3, 6, 17)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]])
    ours = sdft_loss(student, teacher, mask.bool(), cfg.alpha, cfg.top_k, cfg.top_k_tail)
    logits = trl.DistillationLogits(torch.zeros(3, 6, dtype=torch.long), mask, student, teacher)
    theirs = _trl_trainer(trl, cfg).loss(SimpleNamespace(training=True), {}, logits)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad(ours, student)
    torch.testing.assert_close(grad, torch.autograd.grad(theirs, student)[0])


def _trl_inputs(rows: list[dict[str, list[int]]], taught: list[dict[str, list[int]]]) -> Any:
    """The batch TRL builds: prompts padded on the left, completions on the right."""

    def left(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
        return ids, torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])

    def split(row: dict[str, list[int]]) -> tuple[list[int], list[int]]:
        n = sum(t != IGNORE_INDEX for t in row["labels"])
        return row["input_ids"][:-n], row["input_ids"][-n:]

    prompts, completions = zip(*(split(r) for r in rows), strict=True)
    teacher_prompts = [split(r)[0] for r in taught]
    width = max(len(c) for c in completions)
    completion_ids = torch.tensor([list(c) + [0] * (width - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    prompt_ids, prompt_mask = left(list(prompts))
    teacher_ids, teacher_mask = left(teacher_prompts)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "teacher_input_ids": torch.cat([teacher_ids, completion_ids], dim=1),
        "teacher_attention_mask": torch.cat([teacher_mask, completion_mask], dim=1),
    }


@pytest.mark.parametrize("options", [{}, {"alpha": 0.5, "top_k": 5, "skip_tokens": 1}])
def test_the_loss_on_a_sampled_batch_is_trls_sdft_trainer_loss(options: dict[str, Any]) -> None:
    trl = _trl()
    method, ctx = _started(**options)
    with torch.no_grad():  # a teacher that has moved away from the student
        for teacher, _ in method._pairs.values():
            teacher.add_(0.05 * torch.randn_like(teacher))
    rows = _sampled(method, ctx)
    batch = collate(rows, ctx.tokenizer.pad_token_id)
    outputs = ctx.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    ours = method.loss(batch, outputs, StepContext(ctx, 0, 3))
    trainer = _trl_trainer(trl, method.config)
    inputs = _trl_inputs(rows, method._rows)
    logits = trainer._compute_teacher_student_logits(ctx.model, method.teacher, inputs)
    theirs = trainer.loss(ctx.model, inputs, logits)
    assert ours.item() > 0
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_the_ema_teacher_moves_once_per_optimizer_step_by_its_rate() -> None:
    method, ctx = _started(ema_rate=0.25)
    name = next(iter(method._pairs))
    teacher, student = method._pairs[name]
    assert teacher is not student and torch.equal(teacher, student)
    before = teacher.clone()
    with torch.no_grad():
        student.add_(1.0)  # an optimizer step
    _sampled(method, ctx, step=0)  # the first step: nothing to follow yet
    assert torch.equal(teacher, before)
    _sampled(method, ctx, step=1)
    _sampled(method, ctx, step=1)  # a second micro-batch of the same step
    torch.testing.assert_close(teacher, 0.75 * before + 0.25 * student)
    assert not teacher.requires_grad and not method.teacher.training  # type: ignore[union-attr]
    state = method.state_dict()
    again, _ = _started(ema_rate=0.25)
    again.load_state_dict(state)
    assert torch.equal(again._pairs[name][0], teacher)


def test_the_config_fails_at_validate() -> None:
    with pytest.raises(ValidationError, match="exactly the fields"):
        SDFTConfig(template="{prompt} only")
    with pytest.raises(ValidationError, match="top_k_tail needs"):
        SDFTConfig(top_k_tail=True)


def test_a_trainer_refuses_it_naming_the_continual_trainer() -> None:
    line = refusal(method_class("sdft"))
    assert line is not None and "demonstration" in line and "ContinualTrainer" in line


def test_it_runs_in_a_tiny_forgetless_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    raw = tiny_run_config(
        tiny_model_dir,
        method={"name": "sdft", "max_new_tokens": 4},
        train={"steps": 2, "batch_size": 4, "lr": 1e-3, "max_length": 32},
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(config), "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exit_code == 0, result.output
    report = yaml.safe_load((tmp_path / "o" / "results.json").read_text(encoding="utf-8"))
    assert report["status"] == "complete"
    for stats in report["per_task"]:
        assert stats["details"]["sampled_completions"] == 8  # 2 steps of 4
        assert 0 < stats["details"]["mean_sampled_tokens"] <= 4
        assert stats["loss_terms"]["task"] > 0


class Cut(Exception):
    """Stands for a kill in the middle of a step."""


def test_a_run_cut_mid_task_resumes_the_ema_teacher_from_the_step_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train = {"steps": 4, "batch_size": 4, "lr": 1e-3, "max_length": 32, "checkpoint_every": 2}
    method = {"name": "sdft", "max_new_tokens": 4, "ema_rate": 0.5}
    cfg = validate_config(
        tiny_run_config(tiny_model_dir, tasks=["reverse"], method=method, train=train)
    )
    run = lambda out: Runner(cfg, out, Console(quiet=True), progress=False).run().to_json()  # noqa: E731
    full = run(tmp_path / "full")
    original, calls = loop.StepLoop._loss, iter(range(1, 100))

    def cut_at_step_4(self: Any, *args: Any) -> Any:
        if next(calls) == 4:  # after the step-2 checkpoint, the teacher moved twice
            raise Cut
        return original(self, *args)

    monkeypatch.setattr(loop.StepLoop, "_loss", cut_at_step_4)
    with pytest.raises(Cut):
        run(tmp_path / "cut")
    monkeypatch.setattr(loop.StepLoop, "_loss", original)
    resumed = run(tmp_path / "cut")
    assert resumed["per_task"][0]["losses"] == full["per_task"][0]["losses"]
    assert resumed["per_task"][0]["details"] == full["per_task"][0]["details"]
