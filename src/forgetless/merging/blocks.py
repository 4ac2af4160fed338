"""Which weights count as the blocks' matrices (where the matrix-aware rules act)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def is_block_matrix(name: str, weight: torch.Tensor | Sequence[int]) -> bool:
    """A 2-D weight of the transformer blocks: embeddings and the LM head are excluded, and so is
    a tensor that is not floating point."""
    if isinstance(weight, torch.Tensor):
        shape, floating = tuple(weight.shape), weight.is_floating_point()
    else:
        shape, floating = tuple(weight), True
    return len(shape) == 2 and floating and "embed" not in name and "lm_head" not in name
