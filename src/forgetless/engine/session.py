"""One task's life cycle, in one place: start the task, install the method's hooks, train (the
shared step loop, or the method's own stage with an ``sft`` closure over that loop), remove the
hooks; after evaluation, the model to evaluate and the end of the task.

The runner, pretraining, the benchmark harness and the tests all go through ``TaskSession``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from forgetless.contract.hooks import Stage, TaskContext, TaskEndContext
from forgetless.contract.method import Capability, Method
from forgetless.contract.plan import TrainPlan, TrainStats
from forgetless.engine.budget import BudgetMonitor
from forgetless.engine.loop import NonFiniteError, StepLoop
from forgetless.engine.progress import Progress
from forgetless.engine.step_checkpoint import StepCheckpointer
from forgetless.tasks.formatting import Features

CheckpointerFor = Callable[[str, TrainPlan], StepCheckpointer | None]
"""Step checkpoints for one call of the loop: ``""`` for the task's loop, ``"call-NN"`` for the
N-th call of a method's stage (each call resumes on its own); None: no step checkpoints."""


@dataclass
class LoopCall:
    """One run of the shared loop inside a task: its label and the end time of each step."""

    label: str
    start: float
    stamps: list[float] = field(default_factory=list)

    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip([self.start, *self.stamps[:-1]], self.stamps, strict=True)]


@dataclass
class TaskSession:
    """Trains ``ctx``'s task with ``method`` (see the module docstring)."""

    method: Method[Any]
    ctx: TaskContext
    pad_id: int
    progress: Progress | None = None
    on_step: Callable[[str, dict[str, float]], None] | None = None
    on_skip: Callable[[NonFiniteError], None] | None = None
    checkpointer: CheckpointerFor | None = None
    out_dir: Path = Path(".")
    """Where a method's stage may write (``Stage.out_dir``)."""
    label: str = "train"
    """The progress bar's label for the task's own loop."""
    monitor: BudgetMonitor | None = None
    """Holds a forgetting budget in every loop of the task (``forgetless.engine.budget``)."""
    calls: list[LoopCall] = field(default_factory=list)
    """Every run of the shared loop, with its step times (for benchmarks)."""

    @contextmanager
    def started(self) -> Iterator[None]:
        """The task started and the method's hooks in place; the hooks go however it ends."""
        if self.method.uses(Capability.TASK_START):
            self.method.on_task_start(self.ctx)
        handles = (
            self.method.register_hooks(self.ctx)
            if self.method.uses(Capability.ACTIVATION_HOOKS)
            else []
        )
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def train(self, plan: TrainPlan) -> TrainStats:
        """Start the task and train it: the shared loop, or the method's own stage."""
        with self.started():
            if self.method.uses(Capability.TRAIN_STAGE):
                return self._stage(plan)
            return self.loop(plan).run(self.ctx.train_features, plan, label=self.label)

    def evaluated_model(self) -> nn.Module:
        """What is evaluated after training: the method's transform of the model, or the model."""
        if self.method.uses(Capability.MODEL_TRANSFORM):
            return self.method.transform_model(self.ctx.model, self.ctx)
        return self.ctx.model

    def end(self, evals: dict[str, Any], stats: TrainStats) -> None:
        """The method's end-of-task work, given the evaluation and the training stats."""
        if self.method.uses(Capability.TASK_END):
            self.method.on_task_end(TaskEndContext(self.ctx, evals, stats))

    def loop(self, plan: TrainPlan | None = None) -> StepLoop:
        """A run of the shared loop on the task's model, with step checkpoints for ``plan``."""
        return self._loop(self.ctx.model, "", plan)

    def _loop(self, model: nn.Module, folder: str, plan: TrainPlan | None = None) -> StepLoop:
        call = LoopCall(folder or self.label, time.perf_counter())
        self.calls.append(call)

        def stepped(task: str, terms: dict[str, float]) -> None:
            call.stamps.append(time.perf_counter())
            if self.on_step is not None:
                self.on_step(task, terms)

        loop = StepLoop(
            model, self.method, self.ctx, self.pad_id, self.progress, stepped, self.on_skip
        )
        loop.monitor = self.monitor
        if self.checkpointer is not None and plan is not None:
            loop.checkpointer = self.checkpointer(folder, plan)
        return loop

    def _stage(self, plan: TrainPlan) -> TrainStats:
        calls, trained = itertools.count(1), self.ctx.model

        def sft(
            features: list[Features] | None = None,
            loss_fn: Any = None,
            steps: int | None = None,
            lr: float | None = None,
            label: str = "train",
            model: nn.Module | None = None,
        ) -> TrainStats:
            sub = dataclasses.replace(plan, steps=steps or plan.steps, lr=lr or plan.lr)
            # Each call of the stage has its own step checkpoints: a re-run replays the calls
            # that finished (their last checkpoint restores the weights they trained) and
            # resumes the one that was cut.
            loop = self._loop(model if model is not None else trained, "", None)
            if self.checkpointer is not None:
                loop.checkpointer = self.checkpointer(f"call-{next(calls):02d}", sub)
            self.calls[-1].label = label
            data = features if features is not None else self.ctx.train_features
            return loop.run(data, sub, loss_fn, label)

        stage = Stage(ctx=self.ctx, sft=sft, out_dir=self.out_dir, plan=plan)
        return self.method.train_task(stage)
