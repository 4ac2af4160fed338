"""Pure math of Anchored Learning: the anchor, its per-iteration KL bounds, the top-k cache.

From "Stabilizing LLM Supervised Fine-Tuning via Explicit Distributional Control" (summary in
shared/papers/002). Every function works on log-probabilities over the last (vocabulary)
dimension and returns per-position values (no averaging), in the input's dtype (float32 at
least); nothing here registers a method or touches a model.

Notation: ``logp_theta`` = log p_θ(t) (the student when the anchor is formed), ``logp_sft`` =
log p_sft (the frozen SFT reference), ``logq`` = log q_t (the anchor).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Space = Literal["logit", "prob"]

__all__ = [
    "Space",
    "anchor_logprobs",
    "cache_bytes_per_token",
    "cached_anchor_kl",
    "index_dtype",
    "kl_bound",
    "kl_per_position",
    "topk_anchor",
]


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1]; got {alpha}")


def kl_per_position(logp: Tensor, logq: Tensor) -> Tensor:
    """``KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)`` at each position (shape ``logp.shape[:-1]``).

    Entries with ``p_v = 0`` contribute 0 (and a finite gradient); ``q_v = 0`` where ``p_v > 0``
    gives ``inf``.
    """
    dtype = torch.promote_types(torch.promote_types(logp.dtype, logq.dtype), torch.float32)
    lp, lq = logp.to(dtype), logq.to(dtype)
    p = lp.exp()
    ratio = torch.where(p > 0, lp - lq, torch.zeros((), dtype=dtype, device=lp.device))
    return (p * ratio).sum(-1)


def anchor_logprobs(logp_theta: Tensor, logp_sft: Tensor, alpha: float, space: Space) -> Tensor:
    """log q_t, the anchor ``I_α(p_θ(t), p_sft)`` of Anchored Learning ("Stabilizing LLM
    Supervised Fine-Tuning via Explicit Distributional Control").

    - ``logit``: ``q ∝ exp((1−α)·z_θ + α·z_sft)``, the normalised geometric mean
      ``p_θ^(1−α) · p_sft^α``. Log-probabilities serve as the logits: they differ from the raw
      logits by a per-position constant, which the softmax removes.
    - ``prob``: ``q = (1−α)·p_θ + α·p_sft``, the arithmetic mixture, formed in log space as
      ``logaddexp(log(1−α) + log p_θ, log α + log p_sft)`` so that peaked distributions do not
      underflow.

    ``α = 0`` returns ``logp_theta`` and ``α = 1`` returns ``logp_sft`` exactly (both spaces).
    """
    _check_alpha(alpha)
    if logp_theta.shape != logp_sft.shape:
        raise ValueError(f"shapes differ: {tuple(logp_theta.shape)} vs {tuple(logp_sft.shape)}")
    if alpha == 0.0:
        return logp_theta
    if alpha == 1.0:
        return logp_sft
    if space == "logit":
        return torch.log_softmax((1.0 - alpha) * logp_theta + alpha * logp_sft, dim=-1)
    if space == "prob":
        return torch.logaddexp(math.log1p(-alpha) + logp_theta, math.log(alpha) + logp_sft)
    raise ValueError(f"unknown space {space!r} (logit or prob)")


def kl_bound(logp_theta: Tensor, logp_sft: Tensor, alpha: float, space: Space) -> Tensor:
    """The per-iteration upper bound on ``KL(q_t ‖ p_θ(t))`` at each position.

    - ``prob``: ``α · KL(p_sft ‖ p_θ(t))`` (convexity of KL in its first argument; tight as
      ``α → 1``, where it becomes the anchor's own divergence);
    - ``logit``: ``α/(1−α) · KL(p_θ(t) ‖ p_sft)``, note the reversed direction; ``inf`` at
      ``α = 1``, where the anchor is p_sft and the bound says nothing.

    Both are 0 at ``α = 0``. From Anchored Learning ("Stabilizing LLM Supervised Fine-Tuning via
    Explicit Distributional Control").
    """
    _check_alpha(alpha)
    if space == "prob":
        return alpha * kl_per_position(logp_sft, logp_theta)
    if space == "logit":
        kl = kl_per_position(logp_theta, logp_sft)
        if alpha == 1.0:
            return torch.full_like(kl, math.inf)
        return (alpha / (1.0 - alpha)) * kl
    raise ValueError(f"unknown space {space!r} (logit or prob)")


def index_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest signed integer type that holds every token id of the vocabulary."""
    return torch.int16 if vocab_size <= 2**15 else torch.int32


def cache_bytes_per_token(k: int, vocab_size: int) -> int:
    """Bytes the top-k cache stores per completion token: k float32 log-probabilities, k token
    ids (int16 or int32, see ``index_dtype``) and one float32 tail log-mass."""
    k = min(k, vocab_size)
    return k * (4 + torch.empty((), dtype=index_dtype(vocab_size)).element_size()) + 4


def topk_anchor(logq: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k of the anchor with the mass of everything else: ``(values, indices, tail_logmass)``.

    ``values`` (``(..., k)``) are the k largest log q_v, ``indices`` their token ids (int64),
    ``tail_logmass`` (``(...)``) = ``log Σ_{v ∉ top-k} q_v``, a log-sum-exp over the remaining
    entries (not ``log(1 − Σ top-k)``, which cancels catastrophically when the top-k holds
    nearly all the mass). ``k ≥ V`` keeps the whole distribution and a ``-inf`` tail.

    The top-k is taken of q_t itself: separate top-k caches of p_θ(t) and p_sft could not form
    a logit-space anchor, whose support needs both full distributions.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1; got {k}")
    vocab = logq.size(-1)
    k = min(k, vocab)
    values, indices = logq.topk(k, dim=-1)
    if k == vocab:
        tail = torch.full(logq.shape[:-1], -math.inf, dtype=logq.dtype, device=logq.device)
    else:
        tail = logq.scatter(-1, indices, -math.inf).logsumexp(-1)
    return values, indices, tail


def cached_anchor_kl(logp: Tensor, values: Tensor, indices: Tensor, tail_logmass: Tensor) -> Tensor:
    """``KL(q ‖ p_θ)`` at each position from the top-k cache of q (differentiable in ``logp``).

    The k cached tokens enter one by one; the rest of the vocabulary is one bucket, with the
    cached tail mass of q against p_θ's own mass outside the same top-k set:
    ``Σ_{v∈top-k} q_v log(q_v/p_v) + q_tail · log(q_tail / p_tail)``. With ``k = V`` this is the
    exact KL; with ``k < V`` it is the KL between the two coarse-grained distributions, a lower
    bound of the exact one (log-sum inequality) whose gradient still pulls p_θ's top-k
    probabilities and its tail mass toward q's.
    """
    logp = logp.float() if logp.dtype in (torch.float16, torch.bfloat16) else logp
    idx = indices.long()
    values, tail_logmass = values.to(logp.dtype), tail_logmass.to(logp.dtype)
    q_top = values.exp()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    safe_values = torch.where(q_top > 0, values, zero)
    top = (q_top * (safe_values - torch.where(q_top > 0, logp.gather(-1, idx), zero))).sum(-1)
    if idx.size(-1) >= logp.size(-1):
        return top
    logp_tail = logp.scatter(-1, idx, -math.inf).logsumexp(-1)
    q_tail = tail_logmass.exp()
    safe_tail = torch.where(q_tail > 0, tail_logmass, zero)
    return top + q_tail * (safe_tail - torch.where(q_tail > 0, logp_tail, zero))
