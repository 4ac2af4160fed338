"""Continual task arithmetic: each task's update enters the merged model scaled by λ."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from forgetless.contract.method import Capability, MethodConfig, declare_method
from forgetless.merging.config import TaskArithmeticParams
from forgetless.methods.continual_merge import ContinualMerge, Tensors
from forgetless.methods.papers import cite


class TaskArithmeticConfig(MethodConfig, TaskArithmeticParams):
    name: Literal["task_arithmetic"] = "task_arithmetic"
    """Continual task arithmetic."""


@declare_method(
    TaskArithmeticConfig, capabilities={Capability.TRAIN_STAGE}, paper=cite("ilharco2023")
)
class TaskArithmetic(ContinualMerge[TaskArithmeticConfig]):
    """Task arithmetic (Ilharco et al. 2023, "Editing Models with Task Arithmetic", ICLR) run
    continually: task t trains from the merged state θ_{t−1}; its update Δ_t enters as
    θ_t = θ_{t−1} + λ Δ_t, i.e. θ_t = θ_0 + λ Σ_{i≤t} Δ_i. Keeps no state beyond the model.
    """

    smoke: ClassVar[dict[str, Any]] = {"scaling": 0.5}
    unsharded = None  # θ ← θ + λΔ is element-wise: it runs on each process's shards

    def increment(self, deltas: Tensors, details: dict[str, Any]) -> Tensors:
        return {n: self.config.scaling * d for n, d in deltas.items()}
