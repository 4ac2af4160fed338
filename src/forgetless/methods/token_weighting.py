"""Token-weighted SFT losses (DFT, ASFT, EAFT) as pure functions of logits and labels.

Every loss here reads causal-LM ``logits`` ``(B, T, V)`` and ``labels`` ``(B, T)`` (-100 for
tokens outside the loss): position ``t``'s logits predict ``labels[:, t + 1]``. A loss is a sum
over the scored tokens divided by ``num_items`` (a trainer's ``num_items_in_batch``: the scored
tokens of the whole accumulated batch) when given, else by the micro-batch's own scored tokens,
as ``transformers`` normalises its cross-entropy. No scored token gives 0, still attached to
``logits``. Weights are detached: they scale a token's gradient, they are never trained.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from forgetless.tasks.formatting import IGNORE_INDEX

KLDirection = Literal["forward", "reverse"]

LOG_RATIO_CLAMP = 20.0
"""Cap on |log q(y) − log p(y)| in the reverse estimator (NeMo-RL's default): no overflow."""
KL_CLAMP = 10.0
"""Cap of the reverse estimator's per-token value (NeMo-RL's default)."""


def scored(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Next-token logits ``(n, V)`` in float32 and targets ``(n,)`` at the scored positions."""
    if logits.shape[:2] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on (B, T)"
        )
    mask = labels[:, 1:] != IGNORE_INDEX
    return logits[:, :-1][mask].float(), labels[:, 1:][mask]


def normalised(per_token: Tensor, num_items: Tensor | int | None) -> Tensor:
    """``sum(per_token) / num_items``, or the mean when ``num_items`` is None."""
    if num_items is None:
        return per_token.mean()
    if isinstance(num_items, Tensor):
        num_items = num_items.to(per_token.device)
    return per_token.sum() / num_items


def _nothing_scored(logits: Tensor) -> Tensor:
    return logits.sum() * 0.0


def dft_weights(nll: Tensor) -> Tensor:
    """DFT's weight of each token: the model's own probability of it, ``exp(−nll)``, detached."""
    return torch.exp(-nll.detach())


def dft_loss(logits: Tensor, labels: Tensor, num_items: Tensor | int | None = None) -> Tensor:
    """Dynamic Fine-Tuning: ``Σ_t sg(p_θ(y_t)) · (−log p_θ(y_t))``, normalised (module doc)."""
    flat, targets = scored(logits, labels)
    if targets.numel() == 0:
        return _nothing_scored(logits)
    nll = F.cross_entropy(flat, targets, reduction="none")
    return normalised(dft_weights(nll) * nll, num_items)


def forward_kl(flat: Tensor, ref_flat: Tensor) -> Tensor:
    """Per-token ``KL(p_ref ‖ p_θ)`` over the full vocabulary: ``(n, V)`` logits → ``(n,)``."""
    logp, logq = torch.log_softmax(flat, -1), torch.log_softmax(ref_flat.float(), -1)
    return (logq.exp() * (logq - logp)).sum(-1)


def reverse_kl_k3(target_logp: Tensor, ref_target_logp: Tensor) -> Tensor:
    """Per-token estimate of ``KL(p_θ ‖ p_ref)`` from the target token's log-probabilities only:
    Schulman's k3, ``r − 1 − log r`` with ``r = p_ref(y)/p_θ(y)``, both ends clamped."""
    log_ratio = (ref_target_logp - target_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (log_ratio.exp() - 1.0 - log_ratio).clamp(-KL_CLAMP, KL_CLAMP)


def asft_loss(
    logits: Tensor,
    ref_logits: Tensor,
    labels: Tensor,
    alpha: float,
    direction: KLDirection = "forward",
    num_items: Tensor | int | None = None,
) -> Tensor:
    """Anchored SFT: per token, DFT's weighted NLL plus ``alpha`` times a KL to the reference
    (``forward``: ``KL(p_ref ‖ p_θ)`` over the vocabulary; ``reverse``: the k3 estimate of
    ``KL(p_θ ‖ p_ref)`` at the target token), summed and normalised (module doc)."""
    flat, targets = scored(logits, labels)
    if targets.numel() == 0:
        return _nothing_scored(logits)
    ref_flat, _ = scored(ref_logits, labels)
    nll = F.cross_entropy(flat, targets, reduction="none")
    if direction == "forward":
        kl = forward_kl(flat, ref_flat)
    else:
        ref_nll = F.cross_entropy(ref_flat.float(), targets, reduction="none")
        kl = reverse_kl_k3(-nll, -ref_nll)
    return normalised(dft_weights(nll) * nll + alpha * kl, num_items)


def topk_entropy_weight(flat: Tensor, alpha: float, top_k: int) -> Tensor:
    """EAFT's weight of each token, detached: the entropy of the top-``k`` next-token
    distribution (renormalised over those ``k``) divided by ``log k``, its largest value, so
    the weight lies in [0, 1], raised to ``alpha`` (``alpha = 0``: 1 everywhere)."""
    k = min(top_k, flat.size(-1))
    if k < 2:
        raise ValueError(f"top-k entropy needs k >= 2, got {k} (vocabulary {flat.size(-1)})")
    with torch.no_grad():
        logp = torch.log_softmax(flat.topk(k, dim=-1).values, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return torch.pow(entropy / math.log(k), alpha)


def eaft_loss(
    logits: Tensor,
    labels: Tensor,
    alpha: float = 1.0,
    top_k: int = 20,
    num_items: Tensor | int | None = None,
) -> Tensor:
    """Entropy-Adaptive Fine-Tuning: ``Σ_t (H_k(t) / log k)^alpha · (−log p_θ(y_t))``,
    normalised (module doc); ``alpha = 0`` is plain cross-entropy."""
    flat, targets = scored(logits, labels)
    if targets.numel() == 0:
        return _nothing_scored(logits)
    nll = F.cross_entropy(flat, targets, reduction="none")
    return normalised(topk_entropy_weight(flat, alpha, top_k) * nll, num_items)
