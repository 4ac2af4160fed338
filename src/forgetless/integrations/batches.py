"""A trainer's collated batch and forgetless's per-example features, both ways.

A method's batch transform works on examples before collation, as in the step loop (replay
mixes in memory examples, Rolnick et al. 2019, "Experience Replay for Continual Learning";
SAE-FD appends its anchor samples, Zhang et al. 2026); inside a trainer the batch arrives
collated, so it is taken apart by its attention mask, transformed, and collated again,
right-padded, as the step loop does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from forgetless.errors import ConfigError
from forgetless.tasks.formatting import IGNORE_INDEX, Features, collate

COLUMNS = ("input_ids", "attention_mask", "labels")
"""The columns a batch must hold, and may only hold, to be taken apart."""


def uncollate(batch: Mapping[str, Any]) -> list[Features]:
    """Each row's attended tokens and labels (left or right padding alike)."""
    extra = sorted(set(batch) - set(COLUMNS))
    missing = [c for c in COLUMNS if c not in batch]
    if missing or extra:
        raise ConfigError(
            f"forgetless.integrations reads batches of {', '.join(COLUMNS)} only; this one "
            f"lacks {missing} and holds {extra} (padding_free and packing are not supported)"
        )
    mask = batch["attention_mask"].bool().cpu()
    ids, labels = batch["input_ids"].cpu(), batch["labels"].cpu()
    return [
        {"input_ids": ids[r][mask[r]].tolist(), "labels": labels[r][mask[r]].tolist()}
        for r in range(ids.shape[0])
    ]


def recollate(features: list[Features], pad_id: int, device: torch.device) -> dict[str, Any]:
    """``features`` right-padded into a batch on ``device`` (``forgetless.tasks.collate``)."""
    return {k: v.to(device) for k, v in collate(features, pad_id).items()}


def labelled_tokens(labels: torch.Tensor) -> int:
    """Positions a shifted causal-LM loss scores: labels after the first, not ignored."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def rescaled_items(num_items: Any, before: int, after: int) -> Any:
    """The trainer's count of scored tokens (``num_items_in_batch``) for a batch whose own
    count went from ``before`` to ``after``: scaled in proportion, so a loss normalised by it
    weighs the transformed batch's tokens as the trainer weighed the original ones."""
    if num_items is None or before == after or before == 0:
        return num_items
    return num_items * after / before


def features_of(batches: Iterable[Mapping[str, Any]]) -> list[Features]:
    """Every example of ``batches``, in order, as features."""
    return [f for batch in batches for f in uncollate(batch)]
