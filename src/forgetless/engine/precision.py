"""How the step loop computes: the autocast dtype of its forward passes, the fp16 gradient
scaler, and gradient checkpointing of the model's decoder layers."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from forgetless.contract.plan import TrainPlan
from forgetless.errors import ConfigError


@dataclass
class Precision:
    """The forward passes' autocast and, under fp16, a loss scaler (Micikevicius et al. 2018,
    "Mixed Precision Training", arXiv:1710.03740): the loss is multiplied by a scale before the
    backward pass, the gradients divided by it before clipping, and a step whose gradients
    overflow is dropped and the scale lowered (``torch.amp.GradScaler``)."""

    device: torch.device
    dtype: torch.dtype | None = None
    """The autocast dtype; None: no autocast."""
    scaler: torch.amp.GradScaler | None = None
    skipped: list[int] = field(default_factory=list)
    """The steps the scaler dropped for overflowing gradients."""

    @classmethod
    def for_plan(cls, plan: TrainPlan, device: torch.device) -> Precision:
        if plan.fp16:
            return cls(device, torch.float16, torch.amp.GradScaler(device.type))
        return cls(device, torch.bfloat16 if plan.autocast else None)

    def autocast(self) -> AbstractContextManager[Any]:
        dtype = self.dtype or torch.bfloat16
        return torch.autocast(self.device.type, dtype, enabled=self.dtype is not None)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def step(
        self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], limit: float, step: int
    ) -> float:
        """Unscale, clip to ``limit`` and step; the gradient norm before clipping. A step the
        scaler drops reports a norm of 0: its overflow is the scale's, not the model's."""
        if self.scaler is None:
            norm = float(nn.utils.clip_grad_norm_(params, limit))
            if math.isfinite(norm):
                optimizer.step()
            return norm
        self.scaler.unscale_(optimizer)
        norm = float(nn.utils.clip_grad_norm_(params, limit))
        self.scaler.step(optimizer)  # skipped when the unscaled gradients hold an inf or NaN
        self.scaler.update()
        if math.isfinite(norm):
            return norm
        self.skipped.append(step)
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        return {"state": self.scaler.state_dict(), "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state["state"])
            self.skipped = list(state["skipped"])

    def details(self) -> dict[str, Any]:
        """What goes into the task's ``TrainStats.details`` (nothing without a scaler)."""
        if self.scaler is None:
            return {}
        record = {"skipped_steps": len(self.skipped), "steps": self.skipped[:100]}
        return {"grad_scaler": {**record, "final_scale": self.scaler.get_scale()}}


NON_REENTRANT = {"use_reentrant": False}


@contextmanager
def checkpointing(model: nn.Module, on: bool) -> Iterator[None]:
    """``model``'s decoder layers checkpointed while the block runs, when ``on`` (non-reentrant
    ``torch.utils.checkpoint``; Chen et al. 2016, "Training Deep Nets with Sublinear Memory
    Cost", arXiv:1604.06174).

    The input embeddings' output is made to require a gradient, as transformers and PEFT do for
    adapters on frozen weights. Only a forward in training mode with gradients on is
    checkpointed: the methods' extra passes in eval mode or under ``no_grad`` run as before. A
    model already checkpointed is left as it is.
    """
    hf: Any = model  # a transformers (or PEFT) model: its checkpointing methods
    if not on or _checkpointed(hf):
        yield
        return
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"train.gradient_checkpointing: {type(model).__name__} does not support gradient "
            "checkpointing; set it false"
        )
    hooked = _input_grads_hooked(hf)
    _switch(hf, True)
    if not _input_grads_hooked(hf):  # transformers < 5 leaves this to PEFT
        hf.enable_input_require_grads()
    try:
        yield
    finally:
        _switch(hf, False)
        if not hooked and _input_grads_hooked(hf):
            hf.disable_input_require_grads()


def _switch(hf: Any, on: bool) -> None:
    """Checkpointing on or off, by transformers 5's name or the older one."""
    if hasattr(hf, "activation_checkpointing_enable"):
        if on:
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=NON_REENTRANT)
        else:
            hf.activation_checkpointing_disable()
    elif on:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=NON_REENTRANT)
    else:
        hf.gradient_checkpointing_disable()


def _checkpointed(hf: Any) -> bool:
    if hasattr(hf, "is_activation_checkpointing"):
        return bool(hf.is_activation_checkpointing)
    return bool(getattr(hf, "is_gradient_checkpointing", False))


def _input_grads_hooked(hf: Any) -> bool:
    return bool(getattr(hf, "_require_grads_hooks", None)) or (
        getattr(hf, "_require_grads_hook", None) is not None
    )
