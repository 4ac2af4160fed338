"""The one step loop. Every method's per-step hooks are called here; methods never fork it."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import get_scheduler

from forgetless.contract.hooks import Batch, LossFn, StepContext, TaskContext
from forgetless.contract.method import Capability, Method
from forgetless.contract.plan import TrainPlan, TrainStats
from forgetless.core import distributed, registry, sharding
from forgetless.core.zero import ZeroEngine
from forgetless.engine import packing
from forgetless.engine.budget import BudgetMonitor
from forgetless.engine.output_layer import contiguous_output_layer
from forgetless.engine.precision import Precision, checkpointing
from forgetless.engine.progress import Progress
from forgetless.engine.resources import peak_memory_mb
from forgetless.engine.step_checkpoint import LoopProgress, StepCheckpointer
from forgetless.errors import ConfigError, TrainingError
from forgetless.tasks.formatting import IGNORE_INDEX, Features, collate, completion_window


class NonFiniteError(TrainingError):
    """A loss term, the gradient norm or the updated weights are NaN or inf at a task and step."""

    def __init__(self, task: str, step: int, term: str, value: float) -> None:
        if term == "grad_norm":
            what = "non-finite gradient"
        elif term == "weights":
            what = "the weights are no longer finite after the update (is the learning rate sane?)"
        else:
            what = f"loss term {term!r} is {value}"
        super().__init__(f"task {task!r} step {step}: {what}")
        self.task, self.step, self.term, self.value = task, step, term, value

    def event(self, action: str) -> dict[str, Any]:
        """The record that goes into ``results.json``'s ``events``."""
        return {
            "type": "nonfinite",
            "action": action,
            "task": self.task,
            "step": self.step,
            "term": self.term,
            "value": str(self.value),
        }


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (completion) positions."""
    shifted = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    return F.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)


def batches(
    features: list[Features],
    batch_size: int,
    seed: int,
    skip: int = 0,
    grouped: bool = False,
) -> Iterator[list[Features]]:
    """Endless seeded micro-batches, reshuffled every epoch (drop-last when over one batch).

    ``skip`` micro-batches are passed over first (a resumed task replays its data order);
    ``grouped`` batches examples of similar length together (``packing.length_grouped``).
    """
    lengths = [len(f["input_ids"]) for f in features] if grouped else []
    generator = torch.Generator().manual_seed(seed)
    n = len(features)
    per_epoch = n // batch_size if n >= batch_size else 1
    for _ in range(skip // per_epoch):
        torch.randperm(n, generator=generator)
    offset = skip % per_epoch
    while True:
        order = torch.randperm(n, generator=generator).tolist()
        if grouped:
            order = packing.length_grouped(order, lengths, batch_size)
        stop = n - n % batch_size if n >= batch_size else n
        for start in range(offset * batch_size, stop, batch_size):
            yield [features[i] for i in order[start : start + batch_size]]
        offset = 0


def make_optimizer(params: list[nn.Parameter], plan: TrainPlan) -> torch.optim.Optimizer:
    """AdamW, fused into one kernel where the device supports it (HF Trainer's default too)."""
    try:
        return torch.optim.AdamW(params, lr=plan.lr, weight_decay=plan.weight_decay, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=plan.lr, weight_decay=plan.weight_decay)


def check_finite_weights(params: list[nn.Parameter], task: str, step: int) -> None:
    """Stop when an update left a weight NaN or inf, whatever ``on_nonfinite`` says: skipping
    cannot undo an update already applied. Checked before each step checkpoint and at the end,
    since a non-finite weight makes every later loss non-finite too."""
    with torch.no_grad():
        finite = all(bool(torch.isfinite(sharding.local(p)).all()) for p in params)
    if distributed.sharded():  # each process sees its own shards: all stop, or none
        finite = sharding.all_true(finite)
    if not finite:
        raise NonFiniteError(task, step, "weights", math.nan)


def steps_for_epochs(n_examples: int, batch_size: int, grad_accum: int, epochs: float) -> int:
    per_epoch = max(1, n_examples // (batch_size * grad_accum))
    return max(1, math.ceil(per_epoch * epochs))


@dataclass
class StepLoop:
    """Runs ``plan.steps`` optimizer steps of ``model`` on ``features`` with a method's hooks."""

    model: nn.Module
    method: Method
    ctx: TaskContext
    pad_id: int
    progress: Progress | None = None
    on_step: Callable[[str, dict[str, float]], None] | None = None
    """Called after each optimizer step with the task name and the named loss terms."""
    on_skip: Callable[[NonFiniteError], None] | None = None
    """Called for each step dropped under ``on_nonfinite: skip``."""
    checkpointer: StepCheckpointer | None = None
    """Writes step checkpoints and resumes from the last one (None: no step checkpoints)."""
    monitor: BudgetMonitor | None = None
    """Holds a forgetting budget: checks it between steps and steers the method's knob."""
    _trained: nn.Module | None = field(default=None, init=False, repr=False)
    """The module the training forward goes through (``distributed.for_training``)."""
    _zero: ZeroEngine | None = field(default=None, init=False, repr=False)
    """The DeepSpeed engine that reduces and steps under a ZeRO-1/2 launch, else None."""
    _precision: Precision | None = field(default=None, init=False, repr=False)
    """The forward passes' autocast and the fp16 loss scaler of the running loop."""
    _packed: bool = field(default=False, init=False, repr=False)
    """Whether micro-batches go to the model packed into one row (``train.padding_free``)."""
    _padding: list[int] = field(default_factory=lambda: [0, 0], init=False, repr=False)
    """Pad tokens and token slots of the micro-batches run so far (``LoopProgress.padding``)."""

    def run(
        self,
        features: list[Features],
        plan: TrainPlan,
        loss_fn: LossFn | None = None,
        label: str = "train",
    ) -> TrainStats:
        params = self._trainable()
        if not params:
            raise TrainingError(
                f"task {self.ctx.task.name!r}: the model has no trainable parameter"
            )
        distributed.check_batch(plan.batch_size, f"task {self.ctx.task.name!r}")
        optimizer = make_optimizer(params, plan)
        scheduler = get_scheduler(plan.scheduler, optimizer, plan.warmup_steps, plan.steps)
        done = self._resume(optimizer, scheduler)
        self._precision = Precision.for_plan(plan, self.ctx.device)
        self._precision.load_state_dict(done.scaler)
        if self.monitor is not None:
            self.monitor.loop_started(self.model, optimizer, scheduler)
        grouped = self._arrange(plan, loss_fn)
        self._padding = done.padding  # counted on from a resumed step
        stream = batches(features, plan.batch_size, plan.seed, done.step * plan.grad_accum, grouped)
        self.model.train()
        start = time.perf_counter() - done.seconds
        restarts = plan.restart_steps()
        with (
            checkpointing(self.model, plan.gradient_checkpointing),
            contiguous_output_layer(self.model),
            distributed.zero_engine(
                self.model, optimizer, plan.batch_size, plan.max_grad_norm
            ) as self._zero,
            distributed.for_training(self.model) as trained,
            self._bar(label, plan.steps, done.step) as advance,
        ):
            self._trained = self._zero.module if self._zero is not None else trained
            if self._zero is not None and plan.fp16:
                raise ConfigError(
                    "train.autocast: fp16 under DeepSpeed ZeRO is not supported; use bf16"
                )
            first = done.step
            for step in range(first, plan.steps):
                if step in restarts:
                    optimizer.state.clear()  # a fresh AdamW: moments and step count at zero
                sctx = StepContext(
                    task=self.ctx, step=step, total_steps=plan.steps, autocast=plan.autocast
                )
                skip = plan.on_nonfinite == "skip"
                self._record(
                    done, skip, partial(self._step, stream, plan, optimizer, sctx, loss_fn)
                )
                optimizer.zero_grad(set_to_none=True)  # after every step, a skipped one included
                _advance(scheduler, first=step == first)
                if self.monitor is not None:
                    self.monitor.after_step(step, self.model, optimizer, scheduler)
                done.step, done.seconds = step + 1, time.perf_counter() - start
                if self.checkpointer is not None and self.checkpointer.due(done.step, plan.steps):
                    check_finite_weights(params, self.ctx.task.name, step)
                    done.scaler = self._precision.state_dict()
                    self.checkpointer.save(self.model, optimizer, scheduler, done)
                advance(None if math.isnan(done.final_loss) else done.final_loss)
        if self.monitor is not None:
            self.monitor.loop_finished(plan.steps - 1, self.model, optimizer, scheduler)
        check_finite_weights(params, self.ctx.task.name, plan.steps - 1)
        self.model.eval()
        stats = _stats(done, plan)
        stats.details.update(self._precision.details())
        pads, slots = self._padding
        stats.padding_fraction = round(pads / slots, 4) if slots else None
        return stats

    def _record(
        self,
        done: LoopProgress,
        skip: bool,
        step: Callable[[], tuple[float, dict[str, float], int]],
    ) -> None:
        """Run one step and add it to ``done``; a non-finite one is skipped (its update
        dropped) under ``on_nonfinite: skip`` and raised otherwise."""
        try:
            loss, terms, tokens = step()
        except NonFiniteError as err:
            if not skip:
                raise
            done.skipped.append((err.step, err.term, err.value))
            if self.on_skip is not None:
                self.on_skip(err)
            return
        done.tokens += tokens
        for name, value in terms.items():
            done.sums[name] = done.sums.get(name, 0.0) + value
        done.final_loss = loss
        done.losses.append(loss)
        if self.on_step is not None:
            self.on_step(self.ctx.task.name, {"loss": loss, **terms})

    def _resume(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> LoopProgress:
        """The progress restored from the task's step checkpoint, or a fresh start."""
        if self.checkpointer is None:
            return LoopProgress()
        done = self.checkpointer.resume(self.model, optimizer, scheduler)
        if done is None:
            return LoopProgress()
        if self.on_skip is not None:
            for step, term, value in done.skipped:
                self.on_skip(NonFiniteError(self.ctx.task.name, step, term, value))
        return done

    def _bar(self, label: str, total: int, completed: int) -> Any:
        if self.progress is None:
            return _NullBar()
        index, count = self.ctx.task_index, len(self.ctx.run.task_names)
        what = f"task {index}/{count} {label} {self.ctx.task.name}"
        return self.progress.task(what, total, completed, unit="step")

    def _step(
        self,
        stream: Iterator[list[Features]],
        plan: TrainPlan,
        optimizer: torch.optim.Optimizer,
        sctx: StepContext,
        loss_fn: LossFn | None,
    ) -> tuple[float, dict[str, float], int]:
        logged: dict[str, float] = {}
        tokens, total_value = 0, 0.0
        for micro in range(plan.grad_accum):
            feats = next(stream)
            if self.method.uses(Capability.BATCH_TRANSFORM):
                feats = self.method.transform_batch(feats, sctx)
            sctx.global_batch_size = len(feats)
            feats = distributed.shard(feats)
            batch = {k: v.to(self.ctx.device) for k, v in self._collate(feats).items()}
            sctx.batch_share, global_tokens = self._share(batch)
            last = micro == plan.grad_accum - 1
            terms, bad = self._backward(batch, sctx, loss_fn, plan.grad_accum, last)
            if bad is not None:
                raise NonFiniteError(self.ctx.task.name, sctx.step, *bad)
            tokens += global_tokens
            for name, value in terms.items():
                total_value += value / plan.grad_accum
                logged[name] = logged.get(name, 0.0) + value / plan.grad_accum
        pre_step = self._snapshot() if self.method.uses(Capability.UPDATE_GATE) else None
        norm = self._optimizer_step(optimizer, plan, sctx.step)
        if not math.isfinite(norm):
            raise NonFiniteError(self.ctx.task.name, sctx.step, "grad_norm", norm)
        if pre_step is not None:
            with torch.no_grad():
                self.method.gate_update(self.model, pre_step, sctx)
            if self._zero is not None:
                self._zero.weights_written()
        return total_value, logged, tokens

    def _backward(
        self, batch: Batch, sctx: StepContext, loss_fn: LossFn | None, accum: int, last: bool
    ) -> tuple[dict[str, float], tuple[str, float] | None]:
        """One micro-batch's forward and backward; its terms and first non-finite one."""
        wrapped = self._trained or self.model
        sync = nullcontext() if self._zero else distributed.no_gradient_sync(wrapped, not last)
        with sync:
            total, terms, bad = self._loss(batch, sctx, loss_fn)
            scaled = distributed.scale_for_reduction(total / accum, sctx.batch_share)
            if self._zero is None:
                # even when non-finite: the wrapper's reduction must end
                self._scaled(scaled).backward()
                return terms, bad
        if bad is not None:
            # every process sees the same bad term: all step now on NaN gradients, which the
            # engine skips, clearing the gradients it has reduced so far
            scaled = scaled * math.nan
        self._zero.backward(scaled, last=last or bad is not None)
        if bad is not None:
            self._zero.step()
        return terms, bad

    def _arrange(self, plan: TrainPlan, loss_fn: LossFn | None) -> bool:
        """Set up ``train.padding_free``: pack where the model's attention keeps packed
        sequences apart; else say so once and return True (group examples by length)."""
        self._packed = False
        if not plan.padding_free:
            return False
        broken = registry.padding_rule_broken(self.method)
        if broken is None and loss_fn is not None:
            broken = "train.padding_free: a stage's own loss reads the padded rows"
        if broken:
            raise TrainingError(broken)
        self._packed = packing.packs(self.model)
        if not self._packed:
            warnings.warn(
                f"train.padding_free: attention {packing.attention_of(self.model)!r} does not "
                "keep packed sequences apart; batching examples of similar length instead",
                stacklevel=2,
            )
        return not self._packed

    def _collate(self, feats: list[Features]) -> dict[str, torch.Tensor]:
        """The micro-batch as tensors (packed or right-padded), its padding counted."""
        batch = packing.pack(feats) if self._packed else collate(feats, self.pad_id)
        pads, slots = packing.padding_share(batch)
        self._padding[0] += pads
        self._padding[1] += slots
        return batch

    def _optimizer_step(
        self, optimizer: torch.optim.Optimizer, plan: TrainPlan, step: int
    ) -> float:
        """Clip and step (the engine does both under ZeRO); the gradient norm before clipping
        (0 for a step the fp16 scaler dropped)."""
        if self._zero is not None:
            return self._zero.step()
        limit = plan.max_grad_norm if plan.max_grad_norm is not None else math.inf
        precision = self._precision or Precision(self.ctx.device)
        return precision.step(optimizer, self._trainable(), limit, step)

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self._precision.scale(loss) if self._precision is not None else loss

    def _autocast(self, sctx: StepContext) -> Any:
        """The running loop's autocast; outside a run, bf16 as ``sctx`` says."""
        if self._precision is not None:
            return self._precision.autocast()
        return torch.autocast(self.ctx.device.type, torch.bfloat16, enabled=sctx.autocast)

    def _share(self, batch: Batch) -> tuple[float, int]:
        """This process's share of the micro-batch's labelled tokens, and all processes' tokens."""
        attended = batch["attention_mask"].sum()
        if distributed.world_size() == 1:
            return 1.0, int(attended)
        local = torch.stack(
            [distributed.labelled_tokens(batch["labels"], IGNORE_INDEX), attended.double()]
        )
        counts = distributed.weighted_sum(local, 1.0)
        total = float(counts[0])
        share = float(local[0]) / total if total > 0 else 1 / distributed.world_size()
        return share, int(counts[1])

    def _loss(
        self, batch: Batch, sctx: StepContext, loss_fn: LossFn | None
    ) -> tuple[torch.Tensor, dict[str, float], tuple[str, float] | None]:
        """The micro-batch's total loss, its named terms (global values), and the first
        non-finite term (name, value) if any: every process sees the same one."""
        window = {"logits_to_keep": completion_window(batch["labels"])}
        with self._autocast(sctx):
            outputs = (self._trained or self.model)(
                **self._inputs(batch),
                use_cache=False,
                **(window if self._windowed(loss_fn) else {}),
            )
        if loss_fn is not None:
            task_loss = loss_fn(batch, outputs, sctx)
        elif self.method.uses(Capability.REPLACE_LOSS):
            task_loss = self.method.task_loss(batch, outputs, sctx)
        else:
            task_loss = causal_lm_loss(
                outputs.logits, batch["labels"][:, -outputs.logits.shape[1] :]
            )
        terms = {"task": task_loss}
        if self.method.uses(Capability.LOSS_TERMS):
            extra = self.method.loss_terms(batch, outputs, sctx)
            clash = set(extra) & {"task"}
            if clash:
                raise TrainingError(
                    f"method {self.method.name!r} returned a reserved loss name 'task'"
                )
            terms.update(extra)
        local = torch.stack([t.detach().reshape(()).double() for t in terms.values()])
        reduced = distributed.weighted_sum(local, sctx.batch_share).tolist()  # one device sync
        values = dict(zip(terms, reduced, strict=True))
        bad = next(((n, v) for n, v in values.items() if not math.isfinite(v)), None)
        parts = list(terms.values())
        total = parts[0] if len(parts) == 1 else torch.stack([t.reshape(()) for t in parts]).sum()
        return total, values, bad

    def _inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """What the forward is given: a packed row goes without a mask (transformers then
        reads the sequences' boundaries from ``position_ids``)."""
        if "position_ids" in batch:
            return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def _windowed(self, loss_fn: LossFn | None) -> bool:
        """Whether the logits may cover the completion window alone: nothing but the default
        loss reads them, or the method reads them by the tail (``Method.window_ok``,
        ``Method.tail_logits_ok``)."""
        reads = self.method.uses(Capability.REPLACE_LOSS) or self.method.uses(Capability.LOSS_TERMS)
        tail = self.method.window_ok or self.method.tail_logits_ok
        return loss_fn is None and (not reads or tail)

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}


def _stats(done: LoopProgress, plan: TrainPlan) -> TrainStats:
    counted = max(1, plan.steps - len(done.skipped))
    return TrainStats(
        steps=plan.steps,
        seconds=done.seconds,
        tokens=done.tokens,
        final_loss=done.final_loss,
        loss_terms={k: v / counted for k, v in done.sums.items()},
        peak_memory_mb=peak_memory_mb(),
        skipped_steps=len(done.skipped),
        losses=list(done.losses),
    )


class _NullBar:
    def __enter__(self) -> Any:
        return lambda loss: None

    def __exit__(self, *exc: object) -> None:
        return None


def _advance(scheduler: Any, first: bool) -> None:
    """One step of the schedule, which counts planned steps, a skipped one (non-finite, or
    an fp16 scale search) included: torch's warning that no optimizer step came first says
    nothing then. torch checks only on a new scheduler's first step, so the filter is set there
    alone, off the per-step path."""
    if not first:
        scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        scheduler.step()
