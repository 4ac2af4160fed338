"""Padding-free batches: a micro-batch's examples in one row, each sequence's positions from 0.

Transformers (5.x) reads sequence boundaries from ``position_ids`` when no attention mask is
passed: its mask builder makes the causal mask block-diagonal for eager, sdpa and flex
attention, and flash attention runs variable-length kernels over the same boundaries. So a
packed row gives each example the logits it has alone, with no pad token computed. Another
attention implementation may not, and then the loop groups examples of similar length instead.
"""

from __future__ import annotations

from typing import Any

import torch

from forgetless.tasks.formatting import IGNORE_INDEX, Features

PACKED_ATTENTION = frozenset(
    {"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"}
)
"""Attention implementations that keep packed sequences apart by their ``position_ids``."""

GROUP_SPAN = 50
"""Length grouping sorts this many micro-batches' worth of shuffled examples at a time (as
transformers' ``LengthGroupedSampler``): batches of similar lengths, still a random order."""


def pack(features: list[Features]) -> dict[str, torch.Tensor]:
    """``features`` concatenated into one row, with ``position_ids`` restarting at 0 per example.

    Each example's first label is ignored: the padded loss never predicts it either (nothing
    comes before it), and here the previous example's last token would. ``attention_mask`` is
    all ones and counts the tokens; the model must be called without it (see module docstring).
    """
    ids = [t for f in features for t in f["input_ids"]]
    labels = [t for f in features for t in [IGNORE_INDEX, *f["labels"][1:]]]
    positions = [p for f in features for p in range(len(f["input_ids"]))]
    batch = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "labels": torch.tensor([labels], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "attention_mask": torch.ones((1, len(ids)), dtype=torch.long),
    }
    if all("index" in f for f in features):
        batch["index"] = torch.tensor([f["index"][0] for f in features], dtype=torch.long)
    return batch


def padding_share(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """The batch's pad tokens and all its token slots."""
    slots = batch["input_ids"].numel()
    return slots - int(batch["attention_mask"].sum()), slots


def attention_of(model: Any) -> str:
    """The attention implementation ``model`` runs (``eager`` when it does not say)."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "eager")


def packs(model: Any) -> bool:
    """Whether ``model``'s attention keeps packed sequences apart."""
    return attention_of(model) in PACKED_ATTENTION


def length_grouped(order: list[int], lengths: list[int], batch_size: int) -> list[int]:
    """``order`` (a shuffled permutation) rearranged so that consecutive ``batch_size`` runs
    hold examples of similar length: each span of ``GROUP_SPAN`` batches is sorted longest
    first. Padded batches then waste little, at the cost of a less mixed order."""
    span = batch_size * GROUP_SPAN
    grouped: list[int] = []
    for start in range(0, len(order), span):
        chunk = order[start : start + span]
        grouped.extend(sorted(chunk, key=lambda i: -lengths[i]))
    return grouped
