"""What a task trains for (the plan) and what its training gave (the stats)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrainPlan:
    """The resolved training budget of one task (or one inner stage)."""

    steps: int
    batch_size: int
    lr: float
    seed: int
    grad_accum: int = 1
    weight_decay: float = 0.0
    warmup_steps: int = 0
    scheduler: str = "constant"
    max_grad_norm: float | None = 1.0
    on_nonfinite: str = "stop"
    """``stop``: a non-finite loss or gradient raises; ``skip``: drop that step's update."""
    autocast: bool = False
    """Forward passes under bfloat16 autocast (float32 weights and optimizer state)."""
    fp16: bool = False
    """Forward passes under float16 autocast, the loss scaled by a gradient scaler."""
    gradient_checkpointing: bool = False
    """Decoder layers recompute their activations in the backward pass (less memory)."""
    optimizer_restarts: int = 0
    """Times the optimizer's state is cleared within the task, at evenly spaced steps."""
    padding_free: bool = False
    """Pack each micro-batch's examples into one row (no pad token; ``engine.packing``)."""

    def restart_steps(self) -> set[int]:
        """The steps before which the optimizer starts afresh."""
        k = self.optimizer_restarts
        return {round(i * self.steps / (k + 1)) for i in range(1, k + 1)} - {0}


@dataclass
class TrainStats:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    final_loss: float = float("nan")
    loss_terms: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0
    skipped_steps: int = 0
    """Steps whose update was dropped for a non-finite loss or gradient (``on_nonfinite: skip``)."""
    losses: list[float] = field(default_factory=list)
    """The total loss of every optimizer step (the global value over all processes)."""
    padding_fraction: float | None = None
    """The share of pad tokens in the micro-batches the loop ran (0.0 when packed)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Method-specific records (JSON-able) that go into ``results.json`` with the task's stats."""

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "train_seconds": round(self.seconds, 3),
            "steps_per_second": round(self.steps_per_second, 3),
            "tokens_per_second": round(self.tokens_per_second, 1),
            "final_loss": self.final_loss,
            "loss_terms": self.loss_terms,
            "peak_memory_mb": round(self.peak_memory_mb, 1),
            **({"skipped_steps": self.skipped_steps} if self.skipped_steps else {}),
            **(
                {} if self.padding_fraction is None else {"padding_fraction": self.padding_fraction}
            ),
            **({"details": self.details} if self.details else {}),
            "losses": self.losses,
        }
