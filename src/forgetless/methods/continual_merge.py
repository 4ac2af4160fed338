"""Wiring shared by the continual merge methods: train from the merged state, then merge in place.

Task ``t`` trains from ``θ_{t−1}`` (the merged state); its update is ``Δ_t = θ_after − θ_{t−1}``
over the trainable weights (full fine-tuning: every weight; a LoRA ``carry`` adapter: its A and
B, merged as parameters). A method turns the updates into an increment ``ι_t`` and the model is
set to ``θ_t = θ_{t−1} + ι_t`` in place, so evaluation, the checkpoint and the next task all see
the merged weights. On a sharded model (FSDP2) the methods see whole updates (gathered: a trim or
a projection reads a whole tensor) and each increment is split like its weight again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from forgetless.contract.hooks import Stage
from forgetless.contract.method import Method, MethodConfig
from forgetless.contract.plan import TrainStats
from forgetless.core import sharding
from forgetless.core.modules import trainable_parameters

Tensors = dict[str, torch.Tensor]
Increment = Callable[[Tensors, Stage], Tensors]
ConfigT = TypeVar("ConfigT", bound=MethodConfig)


def write_back(params: Mapping[str, nn.Parameter], before: Tensors, increments: Tensors) -> None:
    """``θ ← θ_{t−1} + ι`` for every trainable weight, in its own dtype and device (a whole
    increment split like a sharded weight)."""
    with torch.no_grad():
        for name, param in params.items():
            change = sharding.split_like(increments[name].to(param.device).float(), param)
            param.copy_((before[name].float() + change).to(param.dtype))


def kept_whole(tensors: Mapping[str, torch.Tensor]) -> Tensors:
    """Stored updates as read back on resume, whole on the CPU (a resume of a sharded run
    splits the tensors named like weights; this gathers them again: a collective)."""
    return {name: sharding.replicated(value).cpu() for name, value in tensors.items()}


def train_then_merge(method: str, stage: Stage, increment: Increment) -> TrainStats:
    """Snapshot θ_{t−1}, train through the shared loop, merge ``Δ_t`` by ``increment``."""
    params = trainable_parameters(stage.ctx.model)
    before = {n: p.detach().clone() for n, p in params.items()}
    stats = stage.sft()
    with torch.no_grad():
        deltas = {
            n: sharding.replicated(p.detach().float() - before[n].float())
            for n, p in params.items()
        }
    write_back(params, before, increment(deltas, stage))
    return stats


class ContinualMerge(Method[ConfigT]):
    """Base of the continual merge methods (declared ``TRAIN_STAGE``): each task trains from the
    merged state through the shared loop, then the model takes the change ``increment`` makes of
    the task's update. A subclass writes only ``increment`` and, when it keeps any, its state."""

    carry_only: ClassVar[str | None] = "merges the trainable weights"

    def increment(self, deltas: Tensors, details: dict[str, Any]) -> Tensors:
        """The change ``ι_t`` for the task's updates ``Δ_t`` (by weight name); what it measures
        on the way goes into ``details``, which lands in the task's ``TrainStats.details``."""
        raise NotImplementedError

    def train_task(self, stage: Stage) -> TrainStats:
        details: dict[str, Any] = {}
        stats = train_then_merge(self.name, stage, lambda d, _: self.increment(d, details))
        stats.details.update(details)
        return stats
