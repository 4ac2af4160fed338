"""Holding a forgetting budget while a task trains: measure what is kept, steer the knob.

Every ``check_every`` steps the monitor measures the budget's loss on a small held-out probe
batch (the runner's ``measure``: one minus the probes' retention above chance, or the token KL
to the base) and moves the method's knob (``Method.knob``):

- ``dual``: dual ascent on the knob in log space. With ``v`` the relative violation
  ``(loss − max_loss) / max_loss`` clipped to [−1, 1], the knob is multiplied by ``exp(η·v)``
  when a higher value keeps more (a penalty's weight) and by ``exp(−η·v)`` when a lower one does
  (a learning rate). Over budget it strengthens the method; under budget it relaxes it, so the
  task learns as much as the budget allows (the knob acts as a Lagrange multiplier of the
  constraint ``loss ≤ max_loss``).
- ``adaptive_kl``: the adaptive KL controller of Ziegler et al. 2019 ("Fine-Tuning Language
  Models from Human Preferences", section 2.2), kept as the field's baseline:
  ``β ← β·(1 + e·n/H)`` with ``e = clip(KL/target − 1, −0.2, 0.2)``, ``n`` the steps since the
  last update and ``H`` the horizon.

Under ``dual`` with ``on_violation: rollback`` the monitor also holds a copy of the trainable
weights at the last check within the budget (the loop's start counts as one: the task starts
where the last one ended within it). A check over the budget puts those weights back before it
strengthens the knob, and the loop ends with a last check, so a task never ends over the budget
on the probe batch: the knob alone moves too late, as the damage of the steps before a check
stays (a constrained form of early stopping, that keeps learning with the stronger knob).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from forgetless.config.budget import BudgetConfig
from forgetless.contract.method import Knob, Method
from forgetless.core.modules import trainable_parameters


def relative_violation(loss: float, max_loss: float) -> float:
    """``(loss − max_loss) / max_loss``, clipped to [−1, 1]: the dual step's error signal."""
    return max(-1.0, min(1.0, (loss - max_loss) / max_loss))


def clamp(value: float, knob: Knob) -> float:
    return max(knob.low, min(knob.high, value))


def dual_step(value: float, loss: float, max_loss: float, knob: Knob, step_size: float) -> float:
    """The knob after one dual-ascent step on the measured ``loss`` (module docstring)."""
    sign = 1.0 if knob.keeps_more == "higher" else -1.0
    return clamp(value * math.exp(sign * step_size * relative_violation(loss, max_loss)), knob)


def adaptive_kl_step(
    beta: float, kl: float, target: float, steps: int, horizon: int, knob: Knob
) -> float:
    """Ziegler et al.'s proportional update of the KL coefficient (module docstring)."""
    error = max(-0.2, min(0.2, kl / target - 1.0))
    return clamp(beta * (1.0 + error * steps / horizon), knob)


@dataclass
class BudgetMonitor:
    """Checks the budget during a task's loops and steers ``method``'s knob (module docstring).

    ``measure(model)`` returns the budget's loss on the probe batch; it runs in eval mode
    without gradients, and its time is added to ``seconds`` (the cost the report shows).
    """

    config: BudgetConfig
    method: Method[Any]
    measure: Callable[[nn.Module], float]
    value: float = field(init=False)
    every: int = field(default=1, init=False)
    trace: list[dict[str, float]] = field(default_factory=list, init=False)
    seconds: float = field(default=0.0, init=False)
    _since: int = field(default=0, init=False)
    _kept: list[torch.Tensor] | None = field(default=None, init=False, repr=False)
    """The trainable weights at the last check within the budget (rollback only)."""
    _last_check: int = field(default=-1, init=False)

    def __post_init__(self) -> None:
        if self.method.knob is None:
            raise ValueError(f"method {self.method.name!r} has no knob to steer")
        self.knob: Knob = self.method.knob
        self.value = clamp(self.method.knob_value(), self.knob)
        self.method.set_knob(self.value)

    def begin_task(self, task_steps: int) -> None:
        """A new task: its check interval, a fresh trace (the knob carries over)."""
        self.every, self.trace, self.seconds, self._since = self.config.every(task_steps), [], 0, 0

    @property
    def rolls_back(self) -> bool:
        return self.config.controller == "dual" and self.config.on_violation == "rollback"

    def loop_started(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> None:
        """A learning-rate knob scales a new loop's learning rates by the knob's value; under
        rollback the loop's starting weights are the first ones kept."""
        if self.knob.learning_rate:
            _scale_lr(optimizer, scheduler, self.value)
        self._last_check = -1
        self._kept = _trainable_copy(model) if self.rolls_back else None

    def loop_finished(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> None:
        """After the loop's last step (``step``, 0-based): under rollback, a last check unless
        that step was one; then the kept copy is let go."""
        if self.rolls_back and step >= 0 and self._last_check != step:
            self._check(step, model, optimizer, scheduler)
        self._kept = None

    def after_step(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> None:
        """After optimizer step ``step`` (0-based): check and steer every ``every`` steps."""
        self._since += 1
        if (step + 1) % self.every == 0:
            self._check(step, model, optimizer, scheduler)

    def _check(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> None:
        start = time.perf_counter()
        was_training = model.training
        model.eval()
        with torch.no_grad():
            loss = float(self.measure(model))
            rolled_back = self._keep_or_restore(model, loss)
        model.train(was_training)
        new = self._next(loss)
        if self.knob.learning_rate:
            _scale_lr(optimizer, scheduler, new / self.value)
        self.method.set_knob(new)
        entry = {"step": step + 1, "value": self.value, "loss": loss, "next": new}
        self.trace.append({**entry, "rolled_back": 1.0} if rolled_back else entry)
        self.value, self._since, self._last_check = new, 0, step
        self.seconds += time.perf_counter() - start

    def _keep_or_restore(self, model: nn.Module, loss: float) -> bool:
        """Under rollback: keep the weights within the budget, restore the kept ones otherwise
        (True: restored)."""
        if self._kept is None:
            return False
        params = _trainable(model)
        if loss <= self.config.max_loss:
            _copy_into(self._kept, params)
            return False
        _copy_into(params, self._kept)
        return True

    def _next(self, loss: float) -> float:
        cfg = self.config
        if cfg.controller == "adaptive_kl":
            steps = max(1, self._since)
            return adaptive_kl_step(self.value, loss, cfg.max_loss, steps, cfg.horizon, self.knob)
        return dual_step(self.value, loss, cfg.max_loss, self.knob, cfg.step_size)

    def nothing_kept(self) -> bool:
        """Under rollback, every check of the task was over the budget: it ended where it
        started, as nothing it learned fits inside the budget."""
        return (
            self.rolls_back and bool(self.trace) and all(e.get("rolled_back") for e in self.trace)
        )

    def summary(self) -> dict[str, Any]:
        """The task's trace and cost, for ``results.json``."""
        return {
            "knob": self.knob.field,
            "controller": self.config.controller,
            "check_every": self.every,
            "checks": len(self.trace),
            "rollbacks": sum(1 for e in self.trace if e.get("rolled_back")),
            "seconds": round(self.seconds, 3),
            "trace": list(self.trace),
            "end_value": self.value,
        }


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p.data for p in trainable_parameters(model).values()]


def _trainable_copy(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in _trainable(model)]


def _copy_into(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """One copy per tensor: FSDP2's shards (DTensors) have no fused ``_foreach_copy_``."""
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def _scale_lr(optimizer: torch.optim.Optimizer, scheduler: Any, factor: float) -> None:
    """Multiply the loop's learning rates (and the scheduler's base rates) by ``factor``."""
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]


def budget_miss_line(
    task: str, metric: str, max_loss: float, loss: float | None, monitor: BudgetMonitor
) -> str:
    """One line for a task that ended over its budget: the knob where it ended (at its bound:
    the task cannot be learned inside the budget) and the best check of the task."""
    knob, value = monitor.knob, monitor.value
    strongest = knob.high if knob.keeps_more == "higher" else knob.low
    bound = " (its strongest setting: the task cannot be learned inside the budget)"
    line = (
        f"budget not kept after task {task!r}: {metric} loss {loss:.4f} > {max_loss:g} with "
        f"{knob.field} {value:.4g}{bound if math.isclose(value, strongest) else ''}"
    )
    best = min(monitor.trace, key=lambda e: e["loss"], default=None)
    if best is not None:
        line += (
            f"; best trade-off on the probe batch: loss {best['loss']:.4f} at step "
            f"{int(best['step'])}, {knob.field} {best['value']:.4g}"
        )
    return line


def budget_unlearned_line(task: str, metric: str, max_loss: float, monitor: BudgetMonitor) -> str:
    """One line for a task rolled back at every check: it cannot be learned inside the budget."""
    best = min(e["loss"] for e in monitor.trace)
    return (
        f"task {task!r} cannot be learned inside the budget: every check was over {metric} "
        f"loss {max_loss:g} (the lowest {best:.4f}), so it ended at the weights it started "
        f"from, with {monitor.knob.field} {monitor.value:.4g}"
    )
