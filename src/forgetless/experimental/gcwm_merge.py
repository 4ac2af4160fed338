"""GCWM as a rule of the streaming merge: importing this module registers it.

``forgetless merge`` imports it when a config names ``gcwm``; the stable merge
(``forgetless.merging.streaming``) only looks the rule up, so it never imports this corner.
Plain branch ``Σ_t w_t τ_t`` on every tensor; on the block matrices the geometry correction of
``gcwm_layer`` on rank-``r`` factors of each update (LoRA updates are factored already).
"""

from __future__ import annotations

import torch

from forgetless.core.lowrank import LowRank
from forgetless.experimental.gcwm import gcwm_layer, options_of, truncate
from forgetless.merging.blocks import is_block_matrix
from forgetless.merging.config import GCWMParams
from forgetless.merging.streaming import Delta, TensorMerge, register_tensor_rule
from forgetless.merging.task_arithmetic import COMPUTE, weighted_sum


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


def gcwm_tensor(params: GCWMParams, t: TensorMerge) -> torch.Tensor:
    """One tensor's merged update; the layer's conflict and gate go into the merge's stats."""
    plain = weighted_sum(t.dense(), t.weights)
    if not is_block_matrix(t.name, t.base):
        return plain
    factors = [factored(d, t.base, params.rank) for d in t.deltas]
    layer = gcwm_layer(factors, t.weights, options_of(params))
    t.stats.layers[t.name] = {"conflict": layer.conflict, "gate": layer.gate}
    return plain + layer.correction.dense().to(COMPUTE)


register_tensor_rule("gcwm", gcwm_tensor)
