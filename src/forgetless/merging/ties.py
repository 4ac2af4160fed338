"""TIES-merging (Yadav et al. 2023): trim small entries, elect a sign, average the agreeing ones."""

from __future__ import annotations

from collections.abc import Sequence

import torch

COMPUTE = torch.float32


def trim_top_k(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the ``⌈density·n⌉`` largest-magnitude entries of ``delta``, zero the rest (step 1)."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    flat = delta.to(COMPUTE).flatten()
    keep = int(torch.ceil(torch.tensor(density * flat.numel())).item())
    if keep >= flat.numel():
        return flat.view_as(delta).clone()
    out = torch.zeros_like(flat)
    if keep > 0:
        index = flat.abs().topk(keep, sorted=False).indices
        out[index] = flat[index]
    return out.view_as(delta)


def elect_sign(trimmed: Sequence[torch.Tensor]) -> torch.Tensor:
    """``γ = sgn(Σ_t τ̂_t)``: the sign with the larger total magnitude, per entry (step 2)."""
    return torch.sign(torch.stack([t.to(COMPUTE) for t in trimmed]).sum(dim=0))


def disjoint_mean(trimmed: Sequence[torch.Tensor], sign: torch.Tensor) -> torch.Tensor:
    """Mean over the tasks whose (non-zero) entry agrees with the elected sign (step 3)."""
    stacked = torch.stack([t.to(COMPUTE) for t in trimmed])
    agree = (torch.sign(stacked) == sign.unsqueeze(0)) & (stacked != 0)
    count = agree.sum(dim=0).clamp(min=1)
    return (stacked * agree).sum(dim=0) / count


def ties_merge(
    deltas: Sequence[torch.Tensor], density: float, weights: Sequence[float] | None = None
) -> torch.Tensor:
    """The TIES merged task vector ``τ_m`` (Yadav et al. 2023, "TIES-Merging: Resolving
    Interference When Merging Models", NeurIPS, Alg. 1); the caller adds ``λ·τ_m`` to the base.

    ``weights`` (default 1) scale each task vector before trimming, as mergekit does.
    """
    if not deltas:
        raise ValueError("ties_merge needs at least one task vector")
    weights = [1.0] * len(deltas) if weights is None else list(weights)
    if len(weights) != len(deltas):
        raise ValueError(f"{len(deltas)} task vectors but {len(weights)} weights")
    trimmed = [trim_top_k(d.to(COMPUTE) * w, density) for d, w in zip(deltas, weights, strict=True)]
    return disjoint_mean(trimmed, elect_sign(trimmed))
