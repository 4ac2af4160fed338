"""Task geometry and Bures–Wasserstein conflict, in low-rank factored form.

A geometry is a PSD matrix ``C = G Gᵀ`` (``d × d``) kept as its factor ``G`` (``d × k``). For a
weight update ``Δ`` (``m × d``), ``C = ΔᵀΔ``. The key identity (see docs/geometry.md): for
``A = X Xᵀ`` and ``B = Y Yᵀ``, ``tr (A^{1/2} B A^{1/2})^{1/2} = ‖Xᵀ Y‖_*`` (nuclear norm of a
``k_A × k_B`` matrix), so the Bures–Wasserstein distance never needs a ``d × d`` matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from forgetless.core.lowrank import DTYPE, LowRank, lora_scale, lora_update

__all__ = ["DTYPE", "LowRank", "lora_scale", "lora_update"]


@dataclass(frozen=True)
class Geometry:
    """``C = factor @ factor.T`` (``d × d``), never formed; ``energy`` is the SVD energy kept."""

    factor: torch.Tensor
    energy: float = 1.0

    @property
    def trace(self) -> float:
        return float(self.factor.pow(2).sum())

    def dense(self) -> torch.Tensor:
        return self.factor @ self.factor.T


def full_update(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Full fine-tuning: ``Δ = θ_after − θ_before`` in float64."""
    return after.to(DTYPE) - before.to(DTYPE)


def combine(terms: Sequence[tuple[float, LowRank]]) -> LowRank:
    """``Σ cᵢ Δᵢ`` as one factored update (factors concatenated; rank adds up)."""
    left = torch.cat([c * t.left for c, t in terms], dim=1)
    right = torch.cat([t.right for _, t in terms], dim=0)
    return LowRank(left, right)


def geometry_from_lowrank(update: LowRank) -> Geometry:
    """Exact ``C = ΔᵀΔ`` for ``Δ = L R``: with ``L = Q R_L`` (thin QR), ``G = (R_L R)ᵀ``."""
    _, r_left = torch.linalg.qr(update.left.to(DTYPE), mode="reduced")
    return Geometry((r_left @ update.right.to(DTYPE)).T.contiguous(), 1.0)


def geometry_from_dense(delta: torch.Tensor, rank: int | None = None) -> Geometry:
    """``C = ΔᵀΔ`` via a (truncated) SVD ``Δ ≈ U S Vᵀ``: ``G = V_k S_k``, with the energy kept.

    ``energy = Σ_{i≤k} s_i² / Σ s_i²`` (1.0 when nothing is dropped or ``Δ = 0``).
    """
    delta = delta.to(DTYPE)
    _, s, vh = torch.linalg.svd(delta, full_matrices=False)
    k = s.numel() if rank is None else min(rank, s.numel())
    total = float(s.pow(2).sum())
    energy = float(s[:k].pow(2).sum()) / total if total > 0 else 1.0
    return Geometry((vh[:k].T * s[:k]).contiguous(), energy)


def trace_normalized(geom: Geometry) -> Geometry:
    """``C / tr C`` (the zero geometry stays zero)."""
    norm = geom.factor.pow(2).sum().sqrt()
    if float(norm) == 0.0:
        return geom
    return Geometry(geom.factor / norm, geom.energy)


def fidelity(a: Geometry, b: Geometry) -> float:
    """``tr (A^{1/2} B A^{1/2})^{1/2} = ‖Gₐᵀ G_b‖_*`` (only singular values: no NaN)."""
    if a.factor.numel() == 0 or b.factor.numel() == 0:
        return 0.0
    cross = a.factor.to(DTYPE).T @ b.factor.to(DTYPE)
    return float(torch.linalg.svdvals(cross).sum())


def bures_wasserstein_sq(a: Geometry, b: Geometry) -> float:
    """``BW²(A, B) = tr A + tr B − 2 tr (A^{1/2} B A^{1/2})^{1/2}``, clamped at 0."""
    return max(a.trace + b.trace - 2.0 * fidelity(a, b), 0.0)


def normalized_bw_sq(a: Geometry, b: Geometry) -> float:
    """``BW² / (tr A + tr B)`` in ``[0, 1]``; 0 when both are zero."""
    total = a.trace + b.trace
    if total <= 0.0:
        return 0.0
    return min(max(bures_wasserstein_sq(a, b) / total, 0.0), 1.0)


def psd_sqrt_dense(mat: torch.Tensor) -> torch.Tensor:
    """Symmetric PSD square root by ``eigh``, with negative round-off eigenvalues clamped."""
    mat = (mat.to(DTYPE) + mat.to(DTYPE).T) / 2
    vals, vecs = torch.linalg.eigh(mat)
    return (vecs * vals.clamp(min=0).sqrt()) @ vecs.T


def bures_wasserstein_sq_dense(a: torch.Tensor, b: torch.Tensor) -> float:
    """Dense reference (``O(d³)``) of :func:`bures_wasserstein_sq`, for tests."""
    root_a = psd_sqrt_dense(a)
    cross = psd_sqrt_dense(root_a @ b.to(DTYPE) @ root_a)
    value = float(torch.trace(a.to(DTYPE)) + torch.trace(b.to(DTYPE)) - 2 * torch.trace(cross))
    return max(value, 0.0)


def pairwise_conflict(a: Geometry, b: Geometry, normalize_trace: bool = False) -> float:
    """Conflict of two tasks' geometries: normalized BW², optionally on ``C / tr C``."""
    if normalize_trace:
        a, b = trace_normalized(a), trace_normalized(b)
    return normalized_bw_sq(a, b)


def state_conflict(update: Geometry, state: Geometry, normalize_trace: bool = False) -> float:
    """Conflict of task t's geometry with that of ``Δ_state = θ_{t−1} − θ_base``."""
    return pairwise_conflict(update, state, normalize_trace)


def subspace_alignment(update: Geometry, state: Geometry) -> float:
    """SAR: the share of the update's energy inside the state's dominant right subspace.

    ``‖Q_kᵀ G_u‖²_F / ‖G_u‖²_F``, with ``Q_k`` the state's top ``k`` right singular directions
    and ``k`` the update's rank (its factor's width): 1 when the update moves within the
    directions the state already moved most, about ``k / d`` for an unrelated one. The geometry
    paper compares its state conflict against this ratio as a predictor.
    """
    total = float(update.factor.pow(2).sum())
    if total == 0 or float(state.factor.pow(2).sum()) == 0:
        return 0.0
    u, s, _ = torch.linalg.svd(state.factor.to(DTYPE), full_matrices=False)
    k = min(update.factor.size(1), int((s > s[0] * 1e-10).sum()))
    inside = u[:, :k].T @ update.factor.to(DTYPE)
    return float(inside.pow(2).sum()) / total


def aggregate(values: Sequence[float], weights: Sequence[float] | None = None) -> float | None:
    """Mean over layers, or a weighted mean (e.g. by ``‖Δ_t‖_F`` per layer); None if empty."""
    if not values:
        return None
    if weights is None:
        return sum(values) / len(values)
    total = sum(weights)
    if total <= 0:
        return sum(values) / len(values)
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total
