"""Self-SFT and Iter-SFT: supervised fine-tuning on the model's own answers where they are right.

Both are baselines of Anchored Learning (summary in shared/papers/002). Self-SFT follows Selective
Self-Rehearsal (Gupta et al. 2024, "Selective Self-Rehearsal: A Fine-Tuning Approach to Improve
Generalization in Large Language Models"): the model answers each training prompt first, and where
the task's scorer accepts that answer it becomes the target in place of the gold one, so training
pulls the model less far from its own distribution. Iter-SFT regenerates those targets from the
current model at the start of each of ``rounds`` rounds (one optimizer per round), so answers the
model learns to give in its own words join the targets as it learns.

Where the scorer is exact match, a right answer is the gold answer, and both reduce to SFT.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from forgetless.contract.hooks import Stage
from forgetless.contract.method import Capability, Knob, Method, MethodConfig, declare_method
from forgetless.contract.plan import TrainStats
from forgetless.core.fields import Count
from forgetless.eval.scorers import score_task
from forgetless.tasks.base import Example, Task
from forgetless.tasks.formatting import encode_training_set


def self_targets(
    examples: list[Example], predictions: list[str], correct: list[bool]
) -> list[Example]:
    """``examples`` with each accepted prediction as its completion (the gold one otherwise).

    A chat example's last message, the assistant's answer, is replaced with it.
    """
    out = []
    for example, prediction, right in zip(examples, predictions, correct, strict=True):
        if not right:
            out.append(example)
            continue
        messages = example.messages
        if messages is not None:
            messages = (*messages[:-1], {**messages[-1], "content": prediction})
        out.append(dataclasses.replace(example, completion=prediction, messages=messages))
    return out


def round_steps(total: int, rounds: int) -> list[int]:
    """``total`` steps split over ``rounds`` as evenly as integers allow (earlier rounds longer)."""
    base, extra = divmod(total, rounds)
    return [base + (1 if r < extra else 0) for r in range(rounds)]


class SelfSFTConfig(MethodConfig):
    name: Literal["self_sft"] = "self_sft"
    """Self-SFT / Iter-SFT: SFT on the model's own right answers."""
    rounds: Count = 1
    """Rounds per task, each with targets regenerated from the current model and a fresh optimizer:
    1 is Self-SFT, more is Iter-SFT. The task's steps are split evenly over the rounds."""
    generation_batch: Count = 64
    """Prompts per generation batch."""


@declare_method(SelfSFTConfig, capabilities={Capability.TRAIN_STAGE})
class SelfSFT(Method[SelfSFTConfig]):
    """Generates an answer to every training prompt with the current model, keeps the accepted
    ones as targets, and trains on the mix through the shared loop; records per round the share
    of targets replaced by an answer of its own that differs from the gold one."""

    knob = Knob("lr_scale", keeps_more="lower", low=0.01, high=1.0, learning_rate=True)
    unsharded = "generates its targets with the whole model, which FSDP2 shards do not hold"
    smoke: ClassVar[dict[str, Any]] = {"rounds": 2, "generation_batch": 32}

    def train_task(self, stage: Stage) -> TrainStats:
        ctx, cfg = stage.ctx, self.config
        examples = ctx.task.train[: len(ctx.train_features)]
        stats: list[TrainStats] = []
        shares: list[float] = []
        for r, steps in enumerate(round_steps(stage.plan.steps, cfg.rounds), start=1):
            if steps == 0:
                break
            targets, share = self._targets(ctx.model, ctx.tokenizer, ctx.task, examples)
            features, _ = encode_training_set(
                ctx.tokenizer, targets, ctx.run.max_length, f"task {ctx.task.name!r} self targets"
            )
            shares.append(round(share, 4))
            stats.append(stage.sft(features=features, steps=steps, label=f"round {r}/{cfg.rounds}"))
        return _combined(stats, {"rounds": cfg.rounds, "replaced_share": shares})

    def _targets(
        self, model: Any, tokenizer: Any, task: Task, examples: list[Example]
    ) -> tuple[list[Example], float]:
        if task.scoring is not None and task.scoring.kind == "multiple_choice":
            return examples, 0.0  # the model's right pick is the gold choice itself
        view = dataclasses.replace(task, train=[], eval=examples)
        result = score_task(model, tokenizer, view, self.config.generation_batch)
        targets = self_targets(examples, result.predictions, result.correct)
        changed = sum(t.completion != e.completion for t, e in zip(targets, examples, strict=True))
        return targets, changed / len(examples)


def _combined(stats: list[TrainStats], details: dict[str, Any]) -> TrainStats:
    last = stats[-1]
    return TrainStats(
        steps=sum(s.steps for s in stats),
        seconds=sum(s.seconds for s in stats),
        tokens=sum(s.tokens for s in stats),
        final_loss=last.final_loss,
        loss_terms=last.loss_terms,
        peak_memory_mb=max(s.peak_memory_mb for s in stats),
        skipped_steps=sum(s.skipped_steps for s in stats),
        losses=[x for s in stats for x in s.losses],
        details=details,
    )
