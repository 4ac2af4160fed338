"""GCWM: geometry-conflict Wasserstein merging of task updates, in a shared low-rank basis.

From "Geometry Conflict: Explaining and Controlling Forgetting in LLM Continual Post-Training"
(see docs/merging.md for the equations and what is the paper's versus this toolkit's choice).
Per weight matrix with task updates ``τ_t = L_t R_t`` (``m × d``) and weights ``w_t``:

1. geometries ``C_t = τ_tᵀ τ_t`` as factors ``G_t`` (``geometry.py``), a shared orthonormal basis
   ``Q`` (``d × K``) of ``span{G_t}``, and ``c_t = Qᵀ C_t Q`` (``K × K``; exact, no ``d × d``);
2. the shared metric ``S``: the Gaussian Wasserstein barycenter, fixed point of
   ``S ← Σ_t ŵ_t (S^{1/2} c_t S^{1/2})^{1/2}`` (or, as an ablation, ``S = Σ_t ŵ_t c_t``);
3. the conflict ``κ = Σ_t ŵ_t BW²(C_t, S) / (tr C_t + tr S)`` and a gate ``g(κ)``;
4. whitened updates ``τ̂_t = τ_t Q S_ρ^{−1/2}`` (``S_ρ``: eigenvalues floored at ``ρ·tr S / K``),
   the consensus ``τ̂`` minimizing ``Σ_t w_t ‖(τ̂ − τ̂_t) τ̂_tᵀ‖² / ‖τ̂_t‖²``, i.e.
   ``τ̂ (Σ_t P_t + ε p̄ I) = Σ_t τ̂_t P_t`` with ``P_t = w_t τ̂_tᵀ τ̂_t / ‖τ̂_t‖²`` and
   ``p̄ = tr(Σ_t P_t)/K``, recoloured ``τ_geo = τ̂ S_ρ^{1/2} Qᵀ``;
5. the correction ``C = g · (τ_geo − Σ_t w_t τ_t)``: the merged update is ``Σ_t w_t τ_t + C``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

import forgetless.experimental  # noqa: F401  (the import warning)
from forgetless.core.fields import Count, Fraction, NonNegative, Positive
from forgetless.diagnostics.geometry import (
    DTYPE,
    Geometry,
    LowRank,
    bures_wasserstein_sq_dense,
    geometry_from_lowrank,
    normalized_bw_sq,
    trace_normalized,
)
from forgetless.strict import DocumentedModel

Metric = Literal["barycenter", "mean"]
GateDirection = Literal["hold_back", "amplify"]
GateShape = Literal["linear", "sigmoid", "step"]


RCOND = 1e-10
"""Eigen- and singular values under ``RCOND`` × the largest count as zero."""


class GCWMParams(DocumentedModel):
    """GCWM's knobs (docs/merging.md); the merge config and the continual method share them."""

    rank: Count = 64
    """Truncated-SVD rank kept per task update of a dense (full fine-tuning) matrix; LoRA updates
    are used exactly. Toolkit default (the paper gives none)."""
    metric: Metric = "barycenter"
    """Shared metric: the Gaussian Wasserstein barycenter of the task geometries (the paper), or
    their arithmetic mean (the paper's ablation)."""
    conflict_cancellation: bool = True
    """Let the layer's conflict govern the correction branch (the paper). False is the paper's 'no
    conflict cancellation' ablation, read here as a constant gate = strength."""
    gate_direction: GateDirection = "hold_back"
    """hold_back (the paper's text): high conflict holds back the geometry-aware correction, g = β(1
    − h(κ)); amplify (a public implementation): g = β·h(κ)."""
    gate_shape: GateShape = "linear"
    """h(κ): κ itself, σ((κ − threshold)/temperature), or 1[κ > threshold]."""
    threshold: Fraction = 0.5
    """κ threshold of the sigmoid/step gate."""
    temperature: Positive = 0.1
    """Temperature of the sigmoid gate."""
    strength: Fraction = 1.0
    """β, the largest weight of the correction branch."""
    conflict_trace_normalized: bool = False
    """Compute the conflict on C / tr C (removes the update-size effect)."""
    metric_floor: NonNegative = 1.0
    """ρ: the metric's eigenvalues on the shared span are floored at ρ·tr S / K before whitening (a
    barycenter of low-rank geometries is itself low rank). Toolkit."""
    consensus_ridge: NonNegative = 1e-2
    """ε: ridge ε·tr(ΣP)/K on the consensus system (near-parallel task subspaces make it
    ill-conditioned). Toolkit default."""
    max_iter: Count = 50
    """Barycenter fixed-point iterations at most."""
    tol: NonNegative = 1e-6
    """Barycenter stop: relative Frobenius change (0: always max_iter iterations)."""


@dataclass(frozen=True)
class GCWMLayer:
    """One matrix's result: the correction ``C`` (factored), the conflict, gate and iterations."""

    correction: LowRank
    conflict: float
    gate: float
    iterations: int


def truncate(delta: torch.Tensor, rank: int) -> tuple[LowRank, float]:
    """Best rank-``rank`` factors ``U_k S_k · V_kᵀ`` of a dense update, with the energy kept."""
    u, s, vh = torch.linalg.svd(delta.to(DTYPE), full_matrices=False)
    k = min(rank, s.numel())
    total = float(s.pow(2).sum())
    energy = float(s[:k].pow(2).sum()) / total if total > 0 else 1.0
    return LowRank((u[:, :k] * s[:k]).contiguous(), vh[:k].contiguous()), energy


def _eigh(mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    vals, vecs = torch.linalg.eigh((mat.to(DTYPE) + mat.to(DTYPE).T) / 2)
    return vals.clamp(min=0), vecs


def psd_power(mat: torch.Tensor, power: float, rcond: float = RCOND) -> torch.Tensor:
    """``M^p`` of a symmetric PSD matrix; for ``p < 0``, eigenvalues under ``rcond·λ_max`` → 0."""
    vals, vecs = _eigh(mat)
    top = float(vals.max()) if vals.numel() else 0.0
    keep = vals > rcond * top if top > 0 else torch.zeros_like(vals, dtype=torch.bool)
    powered = torch.where(keep, torch.where(keep, vals, 1.0).pow(power), 0.0)
    return (vecs * powered) @ vecs.T


def shared_basis(factors: Sequence[torch.Tensor], rcond: float = RCOND) -> torch.Tensor:
    """Orthonormal ``Q`` (``d × K``) spanning all factors' columns (thin SVD of ``[G_1 … G_T]``)."""
    stacked = torch.cat([f.to(DTYPE) for f in factors], dim=1)
    if stacked.shape[1] == 0:
        return stacked
    u, s, _ = torch.linalg.svd(stacked, full_matrices=False)
    top = float(s.max()) if s.numel() else 0.0
    return u[:, s > rcond * top] if top > 0 else u[:, :0]


def _normalized(weights: Sequence[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights] if total > 0 else [0.0 for _ in weights]


def _sqrt_of_sandwich(root: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``(R A Aᵀ R)^{1/2} = U Σ Uᵀ`` from the thin SVD ``R A = U Σ Vᵀ`` (``A`` is ``K × r``); a
    square ``A`` (the dense reference) takes one ``eigh`` instead."""
    if factor.shape[1] >= factor.shape[0]:
        side = root @ factor
        return psd_power(side @ side.T, 0.5)
    u, s, _ = torch.linalg.svd(root @ factor, full_matrices=False)
    return (u * s) @ u.T


def bw_barycenter(
    factors: Sequence[torch.Tensor],
    weights: Sequence[float],
    max_iter: int = 50,
    tol: float = 1e-6,
) -> tuple[torch.Tensor, int]:
    """Gaussian Wasserstein barycenter of ``C_t = A_t A_tᵀ`` (weights summing to 1), from the mean.

    Iterates the fixed-point equation ``S = Σ_t w_t (S^{1/2} C_t S^{1/2})^{1/2}`` (Agueh &
    Carlier 2011) as written, each square root from a thin SVD of ``S^{1/2} A_t``; stops when the
    relative Frobenius change is under ``tol``. A dense ``C_t`` is passed as its own factor
    (``A_t = C_t^{1/2}``); the result does not depend on which factor is given.
    """
    s = sum(w * (a.to(DTYPE) @ a.to(DTYPE).T) for w, a in zip(weights, factors, strict=True))
    assert isinstance(s, torch.Tensor)
    for it in range(1, max_iter + 1):
        root = psd_power(s, 0.5)
        new = sum(
            w * _sqrt_of_sandwich(root, a.to(DTYPE)) for w, a in zip(weights, factors, strict=True)
        )
        assert isinstance(new, torch.Tensor)
        new = (new + new.T) / 2
        change = float(torch.linalg.matrix_norm(new - s))
        scale = float(torch.linalg.matrix_norm(s))
        s = new
        if change <= tol * max(scale, 1e-300):
            return s, it
    return s, max_iter


def floored(metric: torch.Tensor, floor: float, span: torch.Tensor | None = None) -> torch.Tensor:
    """``S_ρ``: ``S`` with its eigenvalues on the span raised to at least ``ρ · tr S / K``.

    The barycenter of rank-deficient geometries is itself rank-deficient (a Wasserstein midpoint
    of degenerate Gaussians stays degenerate), so ``S^{−1/2}`` would blow up along the directions
    it lacks; the floor treats those directions at the average scale instead. ``span`` (``d × K``,
    orthonormal) restricts a dense ``d × d`` metric to the shared span.
    """
    inner = metric if span is None else span.T @ metric.to(DTYPE) @ span
    vals, vecs = _eigh(inner)
    level = floor * float(vals.sum()) / max(vals.numel(), 1)
    out = (vecs * vals.clamp(min=level)) @ vecs.T
    return out if span is None else span @ out @ span.T


def gate_value(conflict: float, opts: GCWMParams) -> float:
    """``g(κ)``, ``h`` of the chosen shape: hold_back (paper) ``β(1 − h)``; amplify ``βh``."""
    if not opts.conflict_cancellation:
        return opts.strength
    if opts.gate_shape == "linear":
        h = min(max(conflict, 0.0), 1.0)
    elif opts.gate_shape == "sigmoid":
        h = 1.0 / (1.0 + math.exp(-(conflict - opts.threshold) / opts.temperature))
    else:
        h = 1.0 if conflict > opts.threshold else 0.0
    return opts.strength * ((1.0 - h) if opts.gate_direction == "hold_back" else h)


def consensus(
    whitened: Sequence[torch.Tensor],
    weights: Sequence[float],
    ridge: float,
    span: torch.Tensor | None = None,
    rcond: float = RCOND,
) -> torch.Tensor:
    """``argmin_τ Σ_t w_t ‖(τ − τ_t) τ_tᵀ‖² / ‖τ_t‖² + ridge·p̄‖τ‖²`` in closed form.

    Setting the gradient ``2 Σ_t (τ − τ_t) P_t`` (``P_t = w_t τ_tᵀ τ_t / ‖τ_t‖²``) to zero gives
    ``τ (Σ_t P_t + ε p̄ I) = Σ_t τ_t P_t``; with ``ε = 0`` the pseudo-inverse solution. ``span``
    (dense reference only) puts the ridge on the shared span instead of the whole space.
    """
    k = whitened[0].shape[1]
    p_sum = torch.zeros(k, k, dtype=DTYPE, device=whitened[0].device)
    rhs = torch.zeros_like(whitened[0], dtype=DTYPE)
    for tau, w in zip(whitened, weights, strict=True):
        norm_sq = float(tau.pow(2).sum())
        if w == 0 or norm_sq == 0:
            continue
        p_t = (w / norm_sq) * (tau.T @ tau)
        p_sum += p_t
        rhs += tau @ p_t
    if ridge > 0:
        eye = torch.eye(k, dtype=DTYPE, device=p_sum.device) if span is None else span @ span.T
        p_sum += ridge * float(torch.trace(p_sum)) / float(torch.trace(eye)) * eye
    return rhs @ psd_power(p_sum, -1.0, rcond)


def _conflict(
    geoms: Sequence[Geometry], center: Geometry, weights: Sequence[float], tn: bool
) -> float:
    """``κ = Σ_t ŵ_t BW²(C_t, S)/(tr C_t + tr S)`` via ``geometry.py`` (optionally on C / tr C)."""
    if tn:
        geoms, center = [trace_normalized(g) for g in geoms], trace_normalized(center)
    return float(sum(w * normalized_bw_sq(g, center) for w, g in zip(weights, geoms, strict=True)))


def shared_metric(
    coords: Sequence[torch.Tensor], w_hat: Sequence[float], opts: GCWMParams
) -> tuple[torch.Tensor, int]:
    """The barycenter (or the arithmetic mean, ablation) of ``A_t A_tᵀ``."""
    if opts.metric == "barycenter":
        return bw_barycenter(coords, w_hat, opts.max_iter, opts.tol)
    mean = sum(w * a @ a.T for w, a in zip(w_hat, coords, strict=True))
    assert isinstance(mean, torch.Tensor)
    return mean, 0


def gcwm_layer(updates: Sequence[LowRank], weights: Sequence[float], opts: GCWMParams) -> GCWMLayer:
    """GCWM correction for one weight matrix from factored task updates (never ``d × d``)."""
    if not updates or len(updates) != len(weights):
        raise ValueError(f"gcwm_layer needs matching updates and weights, got {len(updates)}")
    m, d = updates[0].left.shape[0], updates[0].right.shape[1]
    geoms = [geometry_from_lowrank(u) for u in updates]
    basis = shared_basis([g.factor for g in geoms], RCOND)
    if basis.shape[1] == 0 or sum(weights) <= 0:
        zero = LowRank(torch.zeros(m, 0, dtype=DTYPE), torch.zeros(0, d, dtype=DTYPE))
        return GCWMLayer(zero, 0.0, gate_value(0.0, opts), 0)
    w_hat = _normalized(weights)
    coords = [basis.T @ g.factor for g in geoms]
    metric, iters = shared_metric(coords, w_hat, opts)
    kappa = _conflict(
        geoms, Geometry(basis @ psd_power(metric, 0.5)), w_hat, opts.conflict_trace_normalized
    )
    g = gate_value(kappa, opts)
    metric = floored(metric, opts.metric_floor)
    root, inv_root = psd_power(metric, 0.5, RCOND), psd_power(metric, -0.5, RCOND)
    projected = [u.left.to(DTYPE) @ (u.right.to(DTYPE) @ basis) for u in updates]
    whitened = [p @ inv_root for p in projected]
    geo = consensus(whitened, weights, opts.consensus_ridge, None, RCOND) @ root
    plain = sum(w * p for w, p in zip(weights, projected, strict=True))
    correction = LowRank(g * (geo - plain), basis.T.contiguous())
    return GCWMLayer(correction, kappa, g, iters)


def gcwm_layer_dense(
    deltas: Sequence[torch.Tensor], weights: Sequence[float], opts: GCWMParams
) -> tuple[torch.Tensor, float]:
    """Dense ``O(d³)`` reference of :func:`gcwm_layer` (tests, benchmarks): ``(C, κ)``.

    Forms every ``d × d`` matrix; only the shared span (to floor the metric on it, as the
    factored path does implicitly) is taken from the updates' row spaces.
    """
    deltas = [d.to(DTYPE) for d in deltas]
    covs = [d.T @ d for d in deltas]
    w_hat = _normalized(weights)
    metric, _ = shared_metric([psd_power(c, 0.5) for c in covs], w_hat, opts)
    kappa = 0.0
    for w, c in zip(w_hat, covs, strict=True):
        a, b = c, metric
        if opts.conflict_trace_normalized:
            a, b = c / torch.trace(c), metric / torch.trace(metric)
        total = float(torch.trace(a) + torch.trace(b))
        kappa += w * (min(bures_wasserstein_sq_dense(a, b) / total, 1.0) if total > 0 else 0.0)
    g = gate_value(kappa, opts)
    total_cov = torch.zeros_like(covs[0])
    for c in covs:
        total_cov += c
    vals, vecs = _eigh(total_cov)  # the shared span: the range of Σ_t C_t
    span = vecs[:, vals > RCOND * float(vals.max())]
    metric = floored(metric, opts.metric_floor, span)
    root, inv_root = psd_power(metric, 0.5, RCOND), psd_power(metric, -0.5, RCOND)
    whitened = [d @ inv_root for d in deltas]
    geo = consensus(whitened, weights, opts.consensus_ridge, span, RCOND) @ root
    plain = sum(w * d for w, d in zip(weights, deltas, strict=True))
    return g * (geo - plain), kappa
