"""A weight update kept as two factors (a LoRA update, a truncated SVD), never formed densely."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPE = torch.float64


@dataclass(frozen=True)
class LowRank:
    """``Δ = left @ right`` with ``left`` ``m × k`` and ``right`` ``k × d``."""

    left: torch.Tensor
    right: torch.Tensor

    def dense(self) -> torch.Tensor:
        return self.left @ self.right


def lora_scale(alpha: float, r: int, use_rslora: bool = False) -> float:
    """PEFT's scaling: ``α / r``, or ``α / √r`` under rsLoRA."""
    return alpha / (r**0.5) if use_rslora else alpha / r


def lora_update(lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> LowRank:
    """LoRA's effective update ``s · B · A`` (``B`` ``m × r``, ``A`` ``r × d``), kept factored."""
    return LowRank(lora_b.to(DTYPE) * scale, lora_a.to(DTYPE))
