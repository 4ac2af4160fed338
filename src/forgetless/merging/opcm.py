"""OPCM (Tang et al. 2025): continual merging by orthogonal projection and adaptive scaling.

P. Tang, E. Yang, L. Shen, Y. Liu, L. Zhang, D. Tao, "Merging Models on the Fly Without
Retraining: A Sequential Approach to Scalable Continual Model Merging", 2025 (arXiv:2501.09522).
Per weight matrix, the new task vector is projected away from the dominant singular subspace of
the merged update accumulated so far; one global factor ``λ_t`` then rescales the merged update
so its norm stays at the mean task-vector norm. With ``R_t = λ_t τ̄_t`` (the unscaled sum),
``R_t = R_{t−1} + P_{t−1}(τ_t)`` does not depend on the ``λ``'s, so a stream can accumulate ``R``
and scale once: ``τ̄_t = R_t / λ_t`` with ``λ_t = ‖R_t‖ / mean_{i≤t} ‖τ_i‖`` (whole-model norms).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forgetless.merging.task_arithmetic import COMPUTE


def split_rank(singular_values: torch.Tensor, alpha: float) -> int:
    """``r_α``: how many leading singular values keep their cumulative share of ``Σ s`` ≤ ``α``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    total = float(singular_values.sum())
    if total <= 0.0:
        return 0
    share = singular_values.cumsum(0) / total
    return int((share <= alpha).sum())


def projection_mask(rank: int, r_alpha: int, device: torch.device | None = None) -> torch.Tensor:
    """The ``(i, j)`` pairs removed: the ``r_α × r_α`` block of the dominant subspace, and the
    diagonal ``u_i v_iᵀ`` (the directions the merged update itself occupies)."""
    mask = torch.eye(rank, dtype=torch.bool, device=device)
    mask[:r_alpha, :r_alpha] = True
    return mask


def opcm_project(delta: torch.Tensor, merged: torch.Tensor, alpha: float) -> torch.Tensor:
    """``τ̃ = τ − U (M ⊙ Uᵀ τ V) Vᵀ`` with ``R = U S Vᵀ`` (thin SVD, ``s > 0`` only) and mask ``M``.

    An orthogonal projection (Frobenius inner product) onto the complement of
    ``span{u_i v_jᵀ : (i, j) ∈ M}``, so ``⟨τ̃, R⟩ = 0``. Components of ``τ`` outside the row and
    column spans of ``R`` are kept (the authors' code drops them for non-square matrices).
    """
    delta = delta.to(COMPUTE)
    merged = merged.to(COMPUTE)
    if delta.ndim != 2 or delta.shape != merged.shape:
        raise ValueError(f"opcm_project needs equal 2-D shapes, got {delta.shape}, {merged.shape}")
    u, s, vh = torch.linalg.svd(merged.double(), full_matrices=False)
    tol = float(s.max()) * max(merged.shape) * torch.finfo(torch.float64).eps if s.numel() else 0
    keep = int((s > tol).sum())
    if keep == 0:
        return delta.clone()
    u, s, vh = u[:, :keep], s[:keep], vh[:keep]
    coeff = u.T @ delta.double() @ vh.T
    mask = projection_mask(keep, split_rank(s, alpha), coeff.device)
    removed = u @ (coeff * mask) @ vh
    return (delta.double() - removed).to(COMPUTE)


def opcm_accumulate(
    accumulated: torch.Tensor | None, delta: torch.Tensor, alpha: float, project: bool
) -> torch.Tensor:
    """``R_t = R_{t−1} + P_{t−1}(τ_t)`` (``R_1 = τ_1``); ``project=False``: non-matrix weights."""
    delta = delta.to(COMPUTE)
    if accumulated is None:
        return delta.clone()
    if not project:
        return accumulated.to(COMPUTE) + delta
    return accumulated.to(COMPUTE) + opcm_project(delta, accumulated, alpha)


def opcm_lambda(accumulated_norm: float, task_norms: Sequence[float]) -> float:
    """``λ_t = ‖R_t‖ / mean_i ‖τ_i‖`` (1 when either is zero), so ``‖τ̄_t‖`` is the mean norm."""
    if not task_norms:
        raise ValueError("opcm_lambda needs at least one task norm")
    mean = sum(task_norms) / len(task_norms)
    if accumulated_norm <= 0.0 or mean <= 0.0:
        return 1.0
    return accumulated_norm / mean
