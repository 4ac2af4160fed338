"""DARE (Yu et al. 2024): drop delta entries at random and rescale the survivors; then merge the
rescaled updates by task arithmetic, or by TIES's sign election as mergekit's ``dare_ties``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from forgetless.merging.linear import combine
from forgetless.merging.task_arithmetic import COMPUTE
from forgetless.merging.ties import ties_merge

if TYPE_CHECKING:
    from forgetless.merging.config import DareMerge

Rescale = Literal["inverse", "l1", "none"]
L1_FLOOR = 1e-7
"""Below this L1 norm (before or after the drop) mergekit leaves the kept entries unscaled."""


def keep_mask(shape: torch.Size, drop_rate: float, generator: torch.Generator) -> torch.Tensor:
    """True where an entry survives, each with probability ``1 − p``, drawn on the CPU from
    ``generator`` (so the mask is the same on any device)."""
    return torch.rand(shape, generator=generator) >= drop_rate


def drop(
    delta: torch.Tensor, keep: torch.Tensor, drop_rate: float, rescale: Rescale = "inverse"
) -> torch.Tensor:
    """``delta`` zeroed outside ``keep``, the kept entries rescaled by ``rescale``:

    - ``inverse``: by ``1/(1 − p)``, the paper's Eq. 3, so ``E[τ̃] = τ``;
    - ``l1``: by ``‖τ‖₁ / ‖keep ⊙ τ‖₁``, so the tensor keeps its L1 norm (mergekit's
      ``rescale: true``, unscaled when either norm is below ``L1_FLOOR``);
    - ``none``: not at all (mergekit's ``rescale: false``).
    """
    delta = delta.to(COMPUTE)
    kept = delta * keep.to(delta.device)
    if rescale == "inverse":
        return kept / (1.0 - drop_rate)
    if rescale == "l1":
        before, after = delta.abs().sum(), kept.abs().sum()
        if before < L1_FLOOR or after < L1_FLOOR:
            return kept
        return kept * (before / after)
    return kept


def dare(
    delta: torch.Tensor,
    drop_rate: float,
    generator: torch.Generator,
    rescale: Rescale = "inverse",
) -> torch.Tensor:
    """Drop each entry with probability ``p`` and rescale the kept ones (see ``drop``).

    Yu et al. 2024, "Language Models are Super Mario: Absorbing Abilities from Homologous Models
    as a Free Lunch", ICML, Eq. 3: ``m ~ Bernoulli(p)``, ``τ̃ = (1 − m) ⊙ τ / (1 − p)``.
    """
    if not 0.0 <= drop_rate < 1.0:
        raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
    delta = delta.to(COMPUTE)
    if drop_rate == 0.0:
        return delta.clone()
    return drop(delta, keep_mask(delta.shape, drop_rate, generator), drop_rate, rescale)


def mask_seed(seed: int, tensor_index: int, task: int) -> int:
    """The seed of one tensor's mask for one task, so a merge is reproducible tensor by tensor."""
    return seed * 1_000_003 + tensor_index * 1_009 + task


def per_task(value: float | Sequence[float], tasks: int) -> list[float]:
    """One value for every task, or one per task in order."""
    if isinstance(value, int | float):
        return [float(value)] * tasks
    if len(value) != tasks:
        raise ValueError(f"{len(value)} values for {tasks} tasks")
    return [float(v) for v in value]


def merge_dropped(
    dropped: Sequence[torch.Tensor],
    weights: Sequence[float],
    elect_sign: bool,
    normalize: bool,
    scaling: float,
) -> torch.Tensor:
    """The merged update of the rescaled task vectors: ``λ Σ_t w_t τ̃_t`` (over ``Σ_t w_t`` when
    ``normalize``), or with ``elect_sign`` TIES's election in mergekit's convention (the sign of
    ``Σ_t w_t τ̃_t``, + where it is 0; the agreeing ``w_t τ̃_t`` summed, over their weights when
    ``normalize``), as mergekit's ``dare_linear`` and ``dare_ties`` do."""
    if not elect_sign:
        return combine(dropped, weights, normalize, scaling)
    merged = ties_merge(dropped, 1.0, weights, "mergekit", normalize)
    return merged if scaling == 1 else merged * float(scaling)


def dare_merge(
    params: DareMerge, deltas: Sequence[torch.Tensor], weights: Sequence[float], index: int
) -> torch.Tensor:
    """One tensor's DARE merge: each task's mask seeded by ``mask_seed``, then ``merge_dropped``."""
    rates = per_task(params.drop_rate, len(deltas))
    dropped = [
        dare(delta, rate, torch.Generator().manual_seed(mask_seed(params.seed, index, task)),
             params.rescale)
        for task, (delta, rate) in enumerate(zip(deltas, rates, strict=True))
    ]  # fmt: skip
    return merge_dropped(dropped, weights, params.elect_sign, params.normalize, params.scaling)
