"""The trainer callback of a ``ForgettingControl``: what happens around the optimizer step and
between steps, as the step loop does it (``forgetless.engine.loop``).

- an ``UPDATE_GATE`` method sees the weights before and after each optimizer step (the
  trainer's ``on_pre_optimizer_step`` comes after gradient clipping, which leaves weights alone);
- the forgetting budget's monitor starts with each ``train()``, checks after each step (its
  strength changes and rollbacks, ``forgetless.engine.budget``) and makes its last check at the
  end, with the trainer's own optimizer and scheduler;
- at each of the trainer's logging steps the probes are measured, so retention and the KL to
  the base ride on the trainer's own ``log`` to every ``report_to`` integration.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from forgetless.contract.method import Capability


class ForgettingCallback(TrainerCallback):
    """Calls a ``ForgettingControl`` (``forgetting``) at the trainer's events."""

    def __init__(self, forgetting: Any) -> None:
        self.forgetting = forgetting
        self._pre_step: dict[str, torch.Tensor] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        ctl = self.forgetting
        ctl.loop_started(kw["model"], kw["optimizer"], kw["lr_scheduler"], state.max_steps)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.forgetting.method.uses(Capability.UPDATE_GATE):
            self._pre_step = {
                n: p.detach().clone() for n, p in kw["model"].named_parameters() if p.requires_grad
            }

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._pre_step is None:
            return
        with torch.no_grad():
            self.forgetting.method.gate_update(
                kw["model"], self._pre_step, self.forgetting.step_context()
            )
        self._pre_step = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        ctl, model = self.forgetting, kw["model"]
        if ctl.monitor is not None:
            before = len(ctl.monitor.trace)
            ctl.monitor.after_step(
                state.global_step - 1, model, kw["optimizer"], kw["lr_scheduler"]
            )
            ctl.budget_checked(before)
        if control.should_log and ctl.meter is not None:
            ctl.measured = ctl.meter.measure(model)
            ctl.pending.update({"forgetless/" + k: v for k, v in ctl.measured.items()})

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        ctl = self.forgetting
        if ctl.monitor is None:
            return
        before = len(ctl.monitor.trace)
        step = state.global_step - 1
        ctl.monitor.loop_finished(step, kw["model"], kw["optimizer"], kw["lr_scheduler"])
        ctl.budget_checked(before)
