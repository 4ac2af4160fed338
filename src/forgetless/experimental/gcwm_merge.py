"""GCWM as a method of ``forgetless merge``: importing this module registers its config and its
per-tensor rule.

A merge config that names ``gcwm`` imports it through the entry-point group
``forgetless.merge_methods`` (declared in forgetless's ``pyproject.toml``); the stable merge only
looks the method up, so it never imports this corner by name.

Plain branch ``Σ_t w_t τ_t`` on every tensor; on the block matrices the geometry correction of
``gcwm_layer`` on rank-``r`` factors of each update (LoRA updates are factored already).
"""

from __future__ import annotations

from typing import Literal

import torch

from forgetless.core.lowrank import LowRank
from forgetless.experimental.gcwm import GCWMParams, gcwm_layer, truncate
from forgetless.merging.blocks import is_block_matrix
from forgetless.merging.config import MergeMethodConfig, register_merge_method
from forgetless.merging.streaming import Delta, TensorMerge, register_tensor_rule
from forgetless.merging.task_arithmetic import COMPUTE, weighted_sum


@register_merge_method
class GCWMMerge(MergeMethodConfig, GCWMParams):
    name: Literal["gcwm"]
    """Geometry-conflict Wasserstein merging."""


def factored(delta: Delta | None, base: torch.Tensor, rank: int) -> LowRank:
    """``delta`` as low-rank factors: as it is, truncated to ``rank``, or empty when absent."""
    if isinstance(delta, LowRank):
        return delta
    if delta is None:
        m, d = base.shape
        empty = torch.zeros(m, 0, dtype=torch.float64), torch.zeros(0, d, dtype=torch.float64)
        return LowRank(*empty)
    found: LowRank = truncate(delta, rank)[0]
    return found


def gcwm_tensor(params: GCWMMerge, t: TensorMerge) -> torch.Tensor:
    """One tensor's merged update; the layer's conflict and gate go into the merge's stats."""
    plain = weighted_sum(t.dense(), t.weights)
    if not is_block_matrix(t.name, t.base):
        return plain
    factors = [factored(d, t.base, params.rank) for d in t.deltas]
    layer = gcwm_layer(factors, t.weights, params)
    t.stats.layers[t.name] = {"conflict": layer.conflict, "gate": layer.gate}
    return plain + layer.correction.dense().to(COMPUTE)


register_tensor_rule("gcwm", gcwm_tensor)
