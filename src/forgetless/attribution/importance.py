"""Importance maps from parameter relevance, their aggregation over tasks, the gate, the overlap.

Liu et al. 2026 ("Attribution-Guided Continual Learning for Large Language Models",
arXiv:2605.05285): a task's map ``R_t`` aggregates normalized relevance over the samples the model
answers correctly; past maps combine as ``R̄ = [max_τ R_τ]₊`` and the update is scaled by
``1 − R̄``. The paper's text gives no normalization formula; a public description mentions log
scaling and a top-K mean, which is what ``normalize_relevance`` does (docs/attribution.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

Maps = Mapping[str, torch.Tensor]


Sign = Literal["abs", "positive"]
Scaling = Literal["topk_mean", "quantile"]


def normalize_relevance(
    relevance: torch.Tensor,
    top_fraction: float = 0.01,
    log_scale: bool = True,
    sign: Sign = "abs",
    scaling: Scaling = "topk_mean",
) -> torch.Tensor:
    """Map one tensor's relevance to [0, 1].

    ``sign``: ``abs`` takes ``|R|``; ``positive`` keeps ``[R]₊`` (the paper's choice: only
    evidence for the prediction counts). ``scaling``: ``topk_mean`` optionally compresses with
    ``log1p(R / mean R)``, divides by the mean of the top ``top_fraction`` entries and clips at
    1 (a weight reaches 1 only among a sample's top entries); ``quantile`` replaces each entry by
    its rank in the tensor, ``rank / (n − 1)`` (a uniform map whatever the heavy tail; ties,
    zeros included, share their lowest rank).

    Both are scale-free: multiplying ``R`` by a positive constant changes nothing.
    """
    if not 0 < top_fraction <= 1:
        raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction}")
    value = relevance.detach().float()
    magnitude = value.clamp(min=0) if sign == "positive" else value.abs()
    if scaling == "quantile":
        return rank_fraction(magnitude)
    mean = magnitude.mean()
    if not torch.isfinite(mean) or mean == 0:
        return torch.zeros_like(magnitude)
    if log_scale:
        magnitude = torch.log1p(magnitude / mean)
    k = max(1, round(top_fraction * magnitude.numel()))
    scale = magnitude.flatten().topk(k).values.mean()
    return (magnitude / scale).clamp_(0.0, 1.0)


def rank_fraction(values: torch.Tensor) -> torch.Tensor:
    """Each entry's rank among ``values`` as ``rank / (n − 1)`` in [0, 1], ties at their lowest
    rank (an all-equal tensor maps to zeros)."""
    flat = values.flatten()
    if flat.numel() < 2:
        return torch.zeros_like(values)
    ordered = flat.sort().values
    lowest = torch.searchsorted(ordered, flat, right=False)
    return (lowest.float() / (flat.numel() - 1)).view(values.shape)


class MapAccumulator:
    """Running mean of normalized per-sample maps: the task map ``R_t``."""

    def __init__(
        self,
        top_fraction: float,
        log_scale: bool,
        sign: Sign = "abs",
        scaling: Scaling = "topk_mean",
    ) -> None:
        self.top_fraction, self.log_scale = top_fraction, log_scale
        self.sign, self.scaling = sign, scaling
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0

    def normalize(self, relevance: Maps) -> dict[str, torch.Tensor]:
        """One sample's relevance, normalized per tensor."""
        return {
            name: normalize_relevance(
                value, self.top_fraction, self.log_scale, self.sign, self.scaling
            )
            for name, value in relevance.items()
        }

    def add(self, relevance: Maps) -> None:
        self.add_normalized(self.normalize(relevance))

    def add_normalized(self, maps: Maps) -> None:
        """Add a sample already normalized (by an accumulator of the same settings)."""
        for name, norm in maps.items():
            self.sums[name] = self.sums[name] + norm if name in self.sums else norm
        self.count += 1

    def mean(self) -> dict[str, torch.Tensor]:
        if self.count == 0:
            return {}
        return {name: total / self.count for name, total in self.sums.items()}


def permuted_maps(maps: Maps, seed: int) -> dict[str, torch.Tensor]:
    """The control map: each tensor's entries shuffled by a seeded permutation. The gate keeps
    its distribution of strengths (mean, share above ½) and loses only which weight gets which,
    so a gain over this control is the map's placement, not its overall damping."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(maps):
        flat = maps[name].flatten()
        out[name] = flat[torch.randperm(flat.numel(), generator=gen)].view(maps[name].shape)
    return out


def historical_max(previous: Maps, new: Maps) -> dict[str, torch.Tensor]:
    """``R̄ ← [max(R̄, R_t)]₊`` element-wise, in ``previous``'s dtype; one map whatever the
    number of tasks."""
    out = {name: value.clamp(min=0) for name, value in previous.items()}
    for name, value in new.items():
        value = value.clamp(min=0)
        out[name] = torch.maximum(out[name], value.to(out[name].dtype)) if name in out else value
    return out


def keep_factor(
    importance: torch.Tensor, dtype: torch.dtype, strength: float = 1.0
) -> torch.Tensor:
    """The gate ``1 − s·R̄`` in the parameter's dtype (``s = 1``: the paper's gate; ``s`` is
    the knob a forgetting budget can steer)."""
    return (1.0 - strength * importance.float()).to(dtype)


def gate_update_(param: torch.Tensor, before: torch.Tensor, keep: torch.Tensor) -> None:
    """In place: ``θ ← θ_before + keep·(θ − θ_before)`` with ``keep = 1 − R̄``: the optimizer's
    step (weight decay included) scaled per coordinate. ``torch.lerp`` is exact at both ends:
    ``keep = 0`` restores ``θ_before`` bit for bit and ``keep = 1`` keeps the optimizer's ``θ``.
    """
    param.copy_(torch.lerp(before, param, keep))


def top_set(importance: torch.Tensor, fraction: float) -> torch.Tensor:
    """Boolean mask of the ``fraction`` most important entries (ties broken by position)."""
    k = max(1, round(fraction * importance.numel()))
    mask = torch.zeros(importance.numel(), dtype=torch.bool)
    mask[importance.flatten().float().topk(k).indices] = True
    return mask.view(importance.shape)


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|A ∩ B| / |A ∪ B|`` of two boolean masks (1.0 for two empty sets)."""
    union = int((a | b).sum())
    return 1.0 if union == 0 else int((a & b).sum()) / union


def random_jaccard(fraction: float) -> float:
    """Expected Jaccard of two independent random sets of the same fraction: ``p / (2 − p)``."""
    return fraction / (2.0 - fraction)


def overlap(first: Maps, second: Maps, fraction: float) -> dict[str, float]:
    """Jaccard of the top-``fraction`` sets per shared tensor, and ``"overall"`` over all of them
    (the top set taken over the concatenation, so large tensors weigh by size)."""
    names = sorted(set(first) & set(second))
    if not names:
        raise ValueError("the two maps share no parameter")
    out = {n: jaccard(top_set(first[n], fraction), top_set(second[n], fraction)) for n in names}
    flat_a = torch.cat([first[n].flatten().float() for n in names])
    flat_b = torch.cat([second[n].flatten().float() for n in names])
    out["overall"] = jaccard(top_set(flat_a, fraction), top_set(flat_b, fraction))
    return out
