"""Task arithmetic (Ilharco et al. 2023): a merged model is the base plus weighted task vectors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

COMPUTE = torch.float32


def task_vector(base: torch.Tensor, finetuned: torch.Tensor) -> torch.Tensor:
    """``τ = θ_ft − θ_base`` in float32; the shapes must match (no broadcasting)."""
    if finetuned.shape != base.shape:
        raise ValueError(
            f"task vector of shapes {list(finetuned.shape)} against the base's {list(base.shape)}"
        )
    return finetuned.to(COMPUTE) - base.to(COMPUTE)


def weighted_sum(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``Σ_t λ_t τ_t`` in float32 (the task-arithmetic merged update)."""
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} task vectors but {len(weights)} weights")
    if not deltas:
        raise ValueError("weighted_sum needs at least one task vector")
    out = torch.zeros_like(deltas[0], dtype=COMPUTE)
    for delta, weight in zip(deltas, weights, strict=True):
        out.add_(delta.to(COMPUTE), alpha=float(weight))
    return out


def task_arithmetic(
    base: torch.Tensor, deltas: Sequence[torch.Tensor], weights: Sequence[float]
) -> torch.Tensor:
    """``θ = θ_base + Σ_t λ_t τ_t`` (Ilharco et al. 2023, "Editing Models with Task Arithmetic",
    ICLR, Eq. 1 with one λ per task), returned in the base's dtype."""
    return (base.to(COMPUTE) + weighted_sum(deltas, weights)).to(base.dtype)
