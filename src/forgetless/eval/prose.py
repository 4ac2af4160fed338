"""Perplexity and token KL to the base on held-out general prose (plain text, no chat template).

The base's next-token distributions are computed once per run, kept in bfloat16 for the first
``kl_paragraphs`` paragraphs only, in float16 (a 49k-word vocabulary makes each position 100 KB;
bfloat16's 8-bit mantissa would blur log-probs of -10 by 0.06), and every later row is compared
with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from forgetless.eval.metrics import token_kl


@dataclass
class ProseBase:
    """What the base gave on the prose: its perplexity and the KL subset's log-probs."""

    perplexity: float
    logprobs: list[torch.Tensor]
    paragraphs: int

    def as_row(self) -> dict[str, float]:
        """The base's own row: its perplexity, and no divergence from itself."""
        return {
            "perplexity": self.perplexity,
            "kl_base_to_model": 0.0,
            "paragraphs": float(self.paragraphs),
        }


def encode_prose(tokenizer: Any, paragraphs: list[str], max_tokens: int) -> list[torch.Tensor]:
    """Each paragraph's token ids, cut to ``max_tokens``."""
    return [
        torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"][:max_tokens])
        for p in paragraphs
    ]


PROSE_BATCH = 8


@torch.no_grad()
def _batch_logits(model: nn.Module, chunks: list[torch.Tensor]) -> torch.Tensor:
    """Next-token logits of right-padded paragraphs (padding never precedes a real token)."""
    device = next(model.parameters()).device
    width = max(len(c) for c in chunks)
    ids = torch.zeros((len(chunks), width), dtype=torch.long)
    mask = torch.zeros((len(chunks), width), dtype=torch.long)
    for row, chunk in enumerate(chunks):
        ids[row, : len(chunk)], mask[row, : len(chunk)] = chunk, 1
    return model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()


def _measure(
    model: nn.Module, chunks: list[torch.Tensor], kl_paragraphs: int
) -> tuple[float, list[torch.Tensor]]:
    """Perplexity over every paragraph's tokens, and the full log-probs of the first
    ``kl_paragraphs`` paragraphs."""
    nll, count, kept = 0.0, 0, []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(chunks), PROSE_BATCH):
            batch = chunks[start : start + PROSE_BATCH]
            logits = _batch_logits(model, batch)
            for row, ids in enumerate(batch):
                steps = logits[row, : len(ids) - 1]
                norm = torch.logsumexp(steps, dim=-1)
                gold = steps.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1) - norm
                nll, count = nll - float(gold.sum()), count + gold.numel()
                if start + row < kl_paragraphs:
                    kept.append(steps - norm.unsqueeze(-1))
    finally:
        model.train(was_training)
    return math.exp(nll / max(count, 1)), kept


def prose_base(model: nn.Module, chunks: list[torch.Tensor], kl_paragraphs: int) -> ProseBase:
    perplexity, kept = _measure(model, chunks, kl_paragraphs)
    return ProseBase(perplexity, [k.to(torch.float16) for k in kept], len(chunks))


def _kl(base: torch.Tensor, now: torch.Tensor) -> float:
    mask = torch.ones(now.shape[0], dtype=torch.bool)
    return float(token_kl(base, now, mask))


def prose_row(model: nn.Module, chunks: list[torch.Tensor], base: ProseBase) -> dict[str, float]:
    """Perplexity now, and KL(base ‖ model) per token on the KL paragraphs."""
    perplexity, kept = _measure(model, chunks, len(base.logprobs))
    kls = [_kl(b.float(), now) for b, now in zip(base.logprobs, kept, strict=True)]
    return {
        "perplexity": perplexity,
        "kl_base_to_model": sum(kls) / len(kls) if kls else float("nan"),
        "paragraphs": float(len(chunks)),
    }
