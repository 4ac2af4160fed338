"""TIES-merging (Yadav et al. 2023): trim small entries, elect a sign, average the agreeing ones."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forgetless.merging.task_arithmetic import COMPUTE


def kept_count(n: int, density: float, rounding: str = "ceil") -> int:
    """How many of ``n`` entries a density keeps: ``⌈density·n⌉`` (the paper's top-k%), or
    ``⌊density·n⌋`` and at least one, as mergekit's magnitude sparsification rounds."""
    exact = density * n
    if rounding == "floor":
        return max(1, int(exact)) if density > 0 and n else 0
    return int(torch.ceil(torch.tensor(exact)).item())  # float32, as the paper rule always has


def trim_top_k(delta: torch.Tensor, density: float, rounding: str = "ceil") -> torch.Tensor:
    """Keep the ``kept_count`` largest-magnitude entries of ``delta``, zero the rest (step 1)."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    flat = delta.to(COMPUTE).flatten()
    keep = kept_count(flat.numel(), density, rounding)
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
    deltas: Sequence[torch.Tensor],
    density: float | Sequence[float],
    weights: Sequence[float] | None = None,
    convention: str = "paper",
    normalize: bool = True,
) -> torch.Tensor:
    """The TIES merged task vector ``τ_m`` (Yadav et al. 2023, "TIES-Merging: Resolving
    Interference When Merging Models", NeurIPS, Alg. 1); the caller adds ``λ·τ_m`` to the base.

    ``density`` is one share for every task or one per task. ``weights`` (default 1) scale each
    task vector. ``convention="mergekit"`` follows mergekit's
    ``ties`` instead (see ``TiesParams``): ⌊k·n⌋ kept of the unweighted vectors, + elected where
    the weighted sum is ≥ 0, and the agreeing weighted entries summed, divided by the agreeing
    weights when ``normalize``.
    """
    if not deltas:
        raise ValueError("ties_merge needs at least one task vector")
    weights = [1.0] * len(deltas) if weights is None else list(weights)
    if len(weights) != len(deltas):
        raise ValueError(f"{len(deltas)} task vectors but {len(weights)} weights")
    shares = [density] * len(deltas) if isinstance(density, int | float) else list(density)
    if len(shares) != len(deltas):
        raise ValueError(f"{len(deltas)} task vectors but {len(shares)} densities")
    if convention == "mergekit":
        return _mergekit_ties(deltas, shares, weights, normalize)
    trimmed = [
        trim_top_k(d.to(COMPUTE) * w, k) for d, w, k in zip(deltas, weights, shares, strict=True)
    ]
    return disjoint_mean(trimmed, elect_sign(trimmed))


def _mergekit_trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """mergekit's magnitude sparsification: the first ``max(1, ⌊k·n⌋)`` entries of a descending
    ``argsort`` of ``|τ|``. On a large tensor several entries can share the k-th magnitude, and
    ``argsort`` breaks that tie otherwise than ``topk`` does, so the same call is used."""
    flat = delta.to(COMPUTE).flatten()
    keep = kept_count(flat.numel(), density, "floor")
    if keep >= flat.numel():
        return flat.view_as(delta).clone()
    out = torch.zeros_like(flat)
    index = torch.argsort(flat.abs(), descending=True)[:keep]
    out[index] = flat[index]
    return out.view_as(delta)


def _mergekit_ties(
    deltas: Sequence[torch.Tensor],
    densities: Sequence[float],
    weights: Sequence[float],
    normalize: bool,
) -> torch.Tensor:
    kept = torch.stack([_mergekit_trim(d, k) for d, k in zip(deltas, densities, strict=True)])
    w = torch.tensor(list(weights), dtype=COMPUTE).view(-1, *([1] * (kept.ndim - 1)))
    weighted = kept * w
    majority = torch.where(weighted.sum(dim=0) >= 0, 1.0, -1.0)
    agree = (torch.sign(weighted) == majority.unsqueeze(0)).to(COMPUTE)
    merged = (weighted * agree).sum(dim=0)
    if not normalize:
        return merged
    divisor = (w * agree).sum(dim=0)
    return merged / torch.where(divisor == 0, torch.ones_like(divisor), divisor)
