"""A batch of prompts whose shared head runs once.

Chat templates open every prompt with the same tokens (SmolLM2's system turn is 24 of about 50
prompt tokens), and a task's instruction often follows them. Scoring runs those tokens for one
row, repeats their key/value cache over the batch, and left-pads only the rest of each prompt:
the rows hold ``shared head | padding | own tokens``. Positions count real tokens only, so every
token sits where it sat in the plain left-padded batch, and greedy generation and choice
log-likelihoods are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class PromptBatch:
    """``ids``/``mask``: (rows, width), the shared head and then each prompt's own tokens,
    left-padded. ``cache`` holds the head's keys and values for every row (None when nothing is
    shared, or for one row); the model still has ``ids[:, shared:]`` to run."""

    ids: torch.Tensor
    mask: torch.Tensor
    shared: int
    cache: Any | None

    def cache_kwargs(self, keyword: str) -> dict[str, Any]:
        """The keyword argument that hands the head's cache to the model (none without one)."""
        return {} if self.cache is None else {keyword: self.cache}

    def positions(self) -> torch.Tensor:
        """Each token's position among its row's real tokens (padding held at 0)."""
        return (self.mask.cumsum(-1) - 1).clamp(min=0)


def shared_head(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt holds alike, leaving each at least one of its own
    (the last prompt token's logits are the ones asked for)."""
    if len(prompts) < 2:
        return 0
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    count = 0
    while count < limit and all(p[count] == first[count] for p in prompts):
        count += 1
    return count


def left_pad(
    rows: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of ``rows``, padded on the left to the longest."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[index, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def prompt_batch(model: nn.Module, prompts: list[list[int]], pad_id: int) -> PromptBatch:
    """Run the prompts' shared head once and lay the batch out behind it (``PromptBatch``)."""
    device = next(model.parameters()).device
    shared = shared_head(prompts) if _masks_any_layout(model) else 0
    own_ids, own_mask = left_pad([p[shared:] for p in prompts], pad_id, device)
    if shared == 0:
        return PromptBatch(own_ids, own_mask, 0, None)
    head = torch.tensor([prompts[0][:shared]], dtype=torch.long, device=device)
    out = model(input_ids=head, attention_mask=torch.ones_like(head), use_cache=True)
    cache = returned_cache(out)
    cache.batch_repeat_interleave(len(prompts))
    ids = torch.cat([head.expand(len(prompts), -1), own_ids], dim=1)
    mask = torch.cat([torch.ones_like(ids[:, :shared]), own_mask], dim=1)
    return PromptBatch(ids, mask, shared, cache)


def returned_cache(outputs: Any) -> Any:
    """The key/value cache a forward hands back: ``cache`` (transformers 5.x), else the older
    ``past_key_values``."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else outputs.past_key_values


def _masks_any_layout(model: nn.Module) -> bool:
    """Whether the model is a transformers model whose attention takes a mask with padding
    between real tokens (``sdpa`` and ``eager`` do; kernels that unpad by sequence length, and
    models without a transformers config, get plain left padding)."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    return getattr(config, "_attn_implementation", None) in (None, "sdpa", "eager")
