"""One task of the sequence: its plan, its training session (step checkpoints, budget), its
checkpoint with the method's state, and the evaluation row that follows it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from forgetless.config.schema import RunConfig, TaskConfig, probe_names
from forgetless.contract.method import Method, RunInfo, TaskContext
from forgetless.contract.plan import TrainPlan
from forgetless.core.rundir import RunDir
from forgetless.core.storage import load_method_state
from forgetless.engine.budget import BudgetMonitor
from forgetless.engine.loop import NonFiniteError, steps_for_epochs
from forgetless.engine.progress import Progress
from forgetless.engine.session import TaskSession
from forgetless.engine.step_checkpoint import StepCheckpointer, plan_fingerprint
from forgetless.errors import ConfigError
from forgetless.eval.evaluator import Evaluator
from forgetless.models.finetuner import Finetuner
from forgetless.models.loading import load_model
from forgetless.tasks.base import Task
from forgetless.tasks.formatting import Features
from forgetless.training.budget_probe import budget_row
from forgetless.training.results import Results
from forgetless.training.run_writer import RunWriter
from forgetless.training.scale_out import ScaleOut, seed_everything, task_seed
from forgetless.training.task_data import encode_task


def task_plan(cfg: RunConfig, index: int, task_cfg: TaskConfig, n_examples: int) -> TrainPlan:
    """The run's training settings, with the task's own overrides, for task ``index``."""
    t, o = cfg.train, task_cfg.train
    batch_size = o.batch_size or t.batch_size
    epochs = o.epochs or (None if o.steps else t.epochs)
    steps = o.steps or t.steps or 1
    if epochs is not None:
        steps = steps_for_epochs(n_examples, batch_size, t.grad_accum, epochs)
    return TrainPlan(
        steps=steps,
        batch_size=batch_size,
        lr=o.lr or t.lr,
        seed=task_seed(cfg.seed, index),
        grad_accum=t.grad_accum,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        scheduler=t.scheduler,
        max_grad_norm=t.max_grad_norm,
        on_nonfinite=t.on_nonfinite,
        autocast=t.autocast == "bf16",
        fp16=t.autocast == "fp16",
        gradient_checkpointing=t.gradient_checkpointing,
        optimizer_restarts=t.optimizer_restarts,
        padding_free=t.padding_free,
    )


def _skip_event(task: str, skipped: list[NonFiniteError]) -> dict[str, Any]:
    """One ``events`` record for the steps of a task dropped under ``on_nonfinite: skip``."""
    terms: dict[str, int] = {}
    for err in skipped:
        terms[err.term] = terms.get(err.term, 0) + 1
    return {
        "type": "nonfinite",
        "action": "skip",
        "task": task,
        "count": len(skipped),
        "steps": [err.step for err in skipped[:100]],
        "terms": terms,
    }


@dataclass
class TaskLoop:
    """Trains the sequence's tasks one by one with ``method`` on ``finetuner``'s model."""

    cfg: RunConfig
    tasks: list[Task]
    method: Method
    finetuner: Finetuner
    tokenizer: Any
    device: torch.device
    source: str
    writer: RunWriter
    evaluator: Evaluator
    scale: ScaleOut
    bars: Progress
    monitor: BudgetMonitor | None = None
    encoded: dict[int, list[Features]] = field(default_factory=dict)

    def restore(self, completed: int) -> None:
        """Go on after ``completed`` finished tasks: their weights and the method's state."""
        if not completed:
            return
        ckpts = self.writer.task_checkpoints([t.name for t in self.tasks[:completed]])
        missing = [str(c) for c in ckpts if not c.is_dir()]
        if missing:
            raise ConfigError(f"cannot resume: checkpoint missing: {missing[0]}")
        self.finetuner.restore(ckpts)
        state = self.scale.restored_state(load_method_state(ckpts[-1]), self.finetuner)
        self.method.load_state_dict(state)

    def run_task(self, index: int, results: Results) -> None:
        task = self.tasks[index - 1]
        seed_everything(task_seed(self.cfg.seed, index))
        self.finetuner.begin_task(index)
        self.finetuner.model.to(self.device)
        features = self.encoded.pop(index, None)
        if features is None:
            features = encode_task(task, self.tokenizer, self.cfg.train.resolved_max_length)
        ctx = self._context(index, features)
        plan = task_plan(self.cfg, index, self.cfg.tasks[index - 1], len(features))
        if self.monitor is not None:
            self.monitor.begin_task(plan.steps)
        skipped: list[NonFiniteError] = []
        session = self._session(ctx, skipped.append)
        try:
            stats = session.train(plan)
        except NonFiniteError as err:
            results.events.append(err.event("stop"))  # recorded before the error propagates
            results.write(self.writer.out_dir)
            raise
        if skipped:
            results.events.append(_skip_event(task.name, skipped))
        with self.writer.task_checkpoint(index, task.name) as folder:
            self.finetuner.save(folder)
            self.finetuner.end_task()
            ctx.model = self.finetuner.model
            evals = self.record_row(results, session.evaluated_model())
            session.end(evals, stats)
            self.writer.save_state(folder, self.scale.reduced_state(self.method))
        budget = self._budget_row(task.name, results)
        results.per_task.append(
            {"task": task.name, **stats.as_dict(), **self.scale.record(), **budget}
        )
        self.writer.task_done(index, task.name, results)
        self.writer.report_task(index, task.name, stats, results)

    def record_row(self, results: Results, model: torch.nn.Module) -> dict[str, Any]:
        """Evaluate ``model`` into a new row, in float32 even under ``train.autocast``: on CPU,
        bf16 autocast made greedy decoding 3x and choice scoring 5x slower (docs/performance.md).
        Returns the scorings a method's task end reads."""
        between = 0 < len(results.accuracy) < len(self.tasks)  # neither the base nor the last
        row = self.evaluator.score(model, between, base=not results.prose, bars=self.bars.task)
        results.add_row(row)
        return row.results

    def _budget_row(self, task: str, results: Results) -> dict[str, Any]:
        if self.monitor is None or self.cfg.budget is None:
            return {}
        return budget_row(self.cfg.budget, self.monitor, task, results, self.writer.say)

    def _context(self, index: int, features: list[Features]) -> TaskContext:
        cfg = self.cfg
        info = RunInfo(
            seed=cfg.seed,
            out_dir=self.writer.out_dir,
            task_names=[t.name for t in self.tasks],
            probe_names=probe_names(cfg.probes),
            finetune_mode=cfg.finetune.mode,
            max_length=cfg.train.resolved_max_length,
            lora_regime=cfg.finetune.lora.regime if cfg.finetune.mode == "lora" else None,
            load_base=functools.partial(load_model, self.source, cfg.model),
        )
        task = self.tasks[index - 1]
        model, earlier = self.finetuner.model, self.tasks[: index - 1]
        return TaskContext(
            info,
            index,
            task,
            model,
            self.tokenizer,
            features,
            earlier,
            self.device,
            sequence=list(self.tasks),
        )

    def _session(self, ctx: TaskContext, on_skip: Callable[[NonFiniteError], None]) -> TaskSession:
        out_dir = self.writer.out_dir
        folder = RunDir(out_dir).step_checkpoint(ctx.task_index, ctx.task.name)
        every = self.cfg.train.checkpoint_every

        def checkpointer(call: str, plan: TrainPlan) -> StepCheckpointer | None:
            where: Path = folder / call if call else folder
            fingerprint = plan_fingerprint(plan)
            return (
                None if every is None else StepCheckpointer(where, every, self.method, fingerprint)
            )

        tracker = self.writer.tracker
        return TaskSession(
            self.method,
            ctx,
            self.tokenizer.pad_token_id,
            self.bars,
            tracker.log_step,
            on_skip,
            checkpointer,
            out_dir,
            monitor=self.monitor,
        )
