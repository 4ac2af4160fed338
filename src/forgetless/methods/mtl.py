"""Joint multi-task training on every task of the sequence at once: the usual upper reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from forgetless.contract.hooks import Stage
from forgetless.contract.method import Capability, Method, MethodConfig, declare_method
from forgetless.contract.plan import TrainStats
from forgetless.tasks.base import Task
from forgetless.tasks.formatting import Features, encode_example

# --- pure data -----------------------------------------------------------------------------------


def joint_features(tokenizer: Any, tasks: Sequence[Task], max_length: int) -> list[Features]:
    """The union of every task's tokenized training examples, in sequence order."""
    return [encode_example(tokenizer, ex, max_length) for task in tasks for ex in task.train]


def joint_steps(steps_per_task: int, n_tasks: int) -> int:
    """The whole sequence's budget, spent in one stage."""
    return steps_per_task * n_tasks


# --- hook wiring -------------------------------------------------------------------------------


class MTLConfig(MethodConfig):
    name: Literal["mtl"] = "mtl"
    """Joint multi-task training (upper reference)."""


@declare_method(MTLConfig, capabilities={Capability.TRAIN_STAGE})
class MTL(Method[MTLConfig]):
    """Joint multi-task training (MTL): not continual, the reference continual methods aim for.

    The non-sequential upper bound of the continual-learning literature (e.g. Lopez-Paz & Ranzato
    2017, "Gradient Episodic Memory for Continual Learning"; Wang et al. 2023, "TRACE"; Luo et al.
    2023, "An Empirical Study of Catastrophic Forgetting in LLMs during Continual Fine-tuning").

    On the first task it trains on the union of all tasks' training data for the whole sequence's
    budget (the first task's ``plan.steps`` times the number of tasks), with that task's plan
    otherwise; on the later tasks it trains nothing (zero-step stats), having seen them already.
    The rows of its accuracy matrix after task 1 therefore measure nothing sequential, which is why
    ``joint_training`` tells the report to leave out BWT/FWT.
    """

    unsharded = None  # one stage of the shared loop: runs on FSDP2 shards
    joint_training: ClassVar[bool] = True

    def train_task(self, stage: Stage) -> TrainStats:
        ctx = stage.ctx
        if ctx.task_index != 1:
            return TrainStats()
        sequence = ctx.sequence or [ctx.task]
        features = joint_features(ctx.tokenizer, sequence, ctx.run.max_length)
        return stage.sft(
            features=features, steps=joint_steps(stage.plan.steps, len(sequence)), label="joint"
        )
