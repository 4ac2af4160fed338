"""Continual task arithmetic: each task's update enters the merged model scaled by λ."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from forgetless.contract.method import (
    Capability,
    Method,
    MethodConfig,
    Paper,
    Stage,
    declare_method,
)
from forgetless.contract.plan import TrainStats
from forgetless.merging.config import TaskArithmeticParams
from forgetless.methods.continual_merge import Tensors, train_then_merge


class TaskArithmeticConfig(MethodConfig, TaskArithmeticParams):
    name: Literal["task_arithmetic"] = Field(
        "task_arithmetic", description="Continual task arithmetic."
    )


@declare_method(
    "task_arithmetic",
    TaskArithmeticConfig,
    capabilities={Capability.TRAIN_STAGE},
    paper=Paper("Editing Models with Task Arithmetic", "Ilharco et al.", 2023, "ICLR"),
)
class TaskArithmetic(Method[TaskArithmeticConfig]):
    """Task arithmetic (Ilharco et al. 2023, "Editing Models with Task Arithmetic", ICLR) run
    continually: task t trains from the merged state θ_{t−1}; its update Δ_t enters as
    θ_t = θ_{t−1} + λ Δ_t, i.e. θ_t = θ_0 + λ Σ_{i≤t} Δ_i. Keeps no state beyond the model.
    """

    carry_only = "merges the trainable weights"
    smoke: ClassVar[dict[str, Any]] = {"scaling": 0.5}
    unsharded = None  # θ ← θ + λΔ is element-wise: it runs on each process's shards

    def __init__(self, config: TaskArithmeticConfig) -> None:
        super().__init__(config)

    def train_task(self, stage: Stage) -> TrainStats:
        def increment(deltas: Tensors, _: Stage) -> Tensors:
            return {n: self.config.scaling * d for n, d in deltas.items()}

        return train_then_merge(self.name, stage, increment)
