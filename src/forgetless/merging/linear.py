"""Linear combinations of task updates: the weighted sum as mergekit forms it, its optional
normalisation by the weights, and the linear merge (a weighted mean of the models)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forgetless.merging.task_arithmetic import COMPUTE

TINY_WEIGHT_SUM = 1e-8
"""A weight sum this close to 0 is not divided by (mergekit's guard)."""


def weighted_total(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``Σ_t w_t τ_t`` in float32, each ``w_t τ_t`` rounded before the sum over tasks, as
    mergekit does (``add_`` with ``alpha`` fuses the product and can differ in the last bit)."""
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} task vectors but {len(weights)} weights")
    if not deltas:
        raise ValueError("weighted_total needs at least one task vector")
    stacked = torch.stack([d.to(COMPUTE) for d in deltas])
    scale = torch.tensor([float(w) for w in weights], dtype=COMPUTE)
    return stacked.mul_(scale.view(-1, *([1] * (stacked.ndim - 1)))).sum(dim=0)


def normalized(total: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """``total / Σ_t w_t`` (the sum in float32), left as it is when the weights sum to ~0."""
    divisor = _weight_sum(weights)
    return total if float(divisor.abs()) < TINY_WEIGHT_SUM else total / divisor


def combine(
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    normalize: bool = False,
    scaling: float = 1.0,
) -> torch.Tensor:
    """``λ Σ_t w_t τ_t``, divided by ``Σ_t w_t`` first when ``normalize`` (mergekit's
    ``task_arithmetic`` and ``dare_linear`` after their sparsification)."""
    total = weighted_total(deltas, weights)
    if normalize:
        total = normalized(total, weights)
    return total if scaling == 1 else total * float(scaling)


def linear_update(
    base: torch.Tensor,
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    normalize: bool = True,
) -> torch.Tensor:
    """The update that turns ``θ₀`` into the linear merge ``Σ_t w_t θ_t / Σ_t w_t`` (or the
    plain ``Σ_t w_t θ_t`` without ``normalize``), with ``θ_t = θ₀ + τ_t``.

    Wortsman et al. 2022, "Model soups: averaging weights of multiple fine-tuned models improves
    accuracy without increasing inference time", ICML (arXiv:2203.05482), the uniform soup with
    weights. The base enters the mean only as one of the ``θ_t`` (a task whose ``τ`` is 0).
    """
    total = weighted_total(deltas, weights)
    weight_sum = _weight_sum(weights)
    if normalize:
        if float(weight_sum) == 0:
            raise ValueError("a normalized linear merge needs weights that do not sum to 0")
        return total / weight_sum
    return total + (weight_sum - 1.0) * base.to(COMPUTE)


def _weight_sum(weights: Sequence[float]) -> torch.Tensor:
    """``Σ_t w_t`` as a float32 scalar tensor (mergekit sums its weights in float32)."""
    return torch.tensor([float(w) for w in weights], dtype=COMPUTE).sum()
