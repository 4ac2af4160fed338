"""DARE (Yu et al. 2024): drop delta entries at random and rescale the survivors."""

from __future__ import annotations

import torch

COMPUTE = torch.float32


def dare(delta: torch.Tensor, drop_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Drop each entry with probability ``p`` and scale the kept ones by ``1/(1−p)``.

    Yu et al. 2024, "Language Models are Super Mario: Absorbing Abilities from Homologous Models
    as a Free Lunch", ICML, Eq. 3: ``m ~ Bernoulli(p)``, ``τ̃ = (1 − m) ⊙ τ / (1 − p)``, so
    ``E[τ̃] = τ``. The mask is drawn on the CPU from ``generator`` (reproducible on any device).
    """
    if not 0.0 <= drop_rate < 1.0:
        raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
    delta = delta.to(COMPUTE)
    if drop_rate == 0.0:
        return delta.clone()
    keep = torch.rand(delta.shape, generator=generator) >= drop_rate
    return delta * keep.to(delta.device) / (1.0 - drop_rate)
