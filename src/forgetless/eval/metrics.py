"""Continual-learning metrics over an accuracy matrix, plus token-level KL drift.

Accuracy matrix convention
--------------------------
``R`` has ``T + 1`` rows and ``T`` columns, where ``T`` is the number of tasks (1-based):

* row 0 holds the base model's accuracies, measured before any training;
* row ``i`` (``1 <= i <= T``) holds the accuracies after training task ``i``;
* ``R[i][j - 1]`` is the accuracy on task ``j`` after training task ``i``.

In the formulas below ``R[i, j]`` means ``R[i][j - 1]`` (task ``j``, 1-based). All accuracy
metrics return plain Python floats; metrics that need at least two tasks return ``None`` when
``T == 1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

Matrix = Sequence[Sequence[float]]

__all__ = [
    "average_accuracy",
    "average_forgetting",
    "backward_transfer",
    "forward_transfer",
    "plasticity_gain",
    "probe_retention",
    "probe_retention_detail",
    "summarize",
    "token_kl",
]


def _validate(R: Matrix) -> int:
    """Check that ``R`` is a ``(T + 1) x T`` matrix with ``T >= 1``; return ``T``."""
    n_rows = len(R)
    if n_rows < 2:
        raise ValueError(
            f"accuracy matrix needs T + 1 >= 2 rows (row 0 = base model, rows 1..T = after "
            f"each task); got {n_rows} row(s)"
        )
    n_tasks = n_rows - 1
    for i, row in enumerate(R):
        if len(row) != n_tasks:
            raise ValueError(
                f"accuracy matrix must be (T + 1) x T = {n_rows} x {n_tasks}; "
                f"row {i} has {len(row)} entries, expected {n_tasks}"
            )
    return n_tasks


def _at(R: Matrix, i: int, j: int) -> float:
    """Accuracy on task ``j`` (1-based) after training task ``i`` (0 = base model)."""
    return float(R[i][j - 1])


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def average_accuracy(R: Matrix) -> float:
    """Average accuracy after the last task (ACC).

    Formula: ``ACC = (1 / T) * sum_{j=1..T} R[T, j]``.

    Higher is better. Source: Lopez-Paz & Ranzato (2017), "Gradient Episodic Memory for
    Continual Learning" (GEM).
    """
    T = _validate(R)
    return _mean([_at(R, T, j) for j in range(1, T + 1)])


def backward_transfer(R: Matrix) -> float | None:
    """Backward transfer (BWT): how training later tasks changed accuracy on earlier ones.

    Formula: ``BWT = (1 / (T - 1)) * sum_{j=1..T-1} (R[T, j] - R[j, j])``.

    Sign: negative BWT means forgetting (accuracy on task ``j`` dropped between the moment it
    was learned and the end of the sequence); positive BWT means later tasks helped earlier
    ones. Returns ``None`` when ``T == 1``.

    Source: Lopez-Paz & Ranzato (2017), "Gradient Episodic Memory for Continual Learning".
    """
    T = _validate(R)
    if T == 1:
        return None
    return _mean([_at(R, T, j) - _at(R, j, j) for j in range(1, T)])


def forward_transfer(R: Matrix) -> float | None:
    """Forward transfer (FWT): how earlier tasks change zero-shot accuracy on the next task.

    Formula: ``FWT = (1 / (T - 1)) * sum_{j=2..T} (R[j - 1, j] - R[0, j])``.

    This is GEM's definition with one change: GEM compares against ``b_j``, the accuracy of a
    randomly initialised model on task ``j``; here the baseline is the base (pre-trained)
    model's accuracy ``R[0, j]``. Positive FWT means the tasks trained so far improved
    accuracy on task ``j`` before it was trained; negative means they hurt it. Returns
    ``None`` when ``T == 1``.

    Source: Lopez-Paz & Ranzato (2017), "Gradient Episodic Memory for Continual Learning".
    """
    T = _validate(R)
    if T == 1:
        return None
    return _mean([_at(R, j - 1, j) - _at(R, 0, j) for j in range(2, T + 1)])


def plasticity_gain(R: Matrix) -> float:
    """Plasticity gain: how much training on each task improved it over the base model.

    Formula: ``gain = (1 / T) * sum_{j=1..T} (R[j, j] - R[0, j])``.

    Positive is good (the model learned each task); near zero or negative means the method
    was too rigid to learn. Complements BWT/forgetting, which measure stability. Measured
    against the base model's row 0, in the same spirit as this module's FWT.
    """
    T = _validate(R)
    return _mean([_at(R, j, j) - _at(R, 0, j) for j in range(1, T + 1)])


ForgettingSince = Literal["any", "learned"]


def average_forgetting(R: Matrix, since: ForgettingSince = "any") -> float | None:
    """Average forgetting: mean drop from each earlier task's best accuracy to its final one.

    Formula (``since="any"``, the default): for each task ``j < T``,
    ``f_j = max_{l=1..T-1} R[l, j] - R[T, j]``, and ``F = (1 / (T - 1)) * sum_j f_j``. The
    maximum runs over the rows after every task but the last, including the rows *before* task
    ``j`` was trained (a task helped by an earlier one counts that peak too); the base row 0 is
    left out. This is the definition of Chaudhry et al. (2018), "Riemannian Walk for Incremental
    Learning: Understanding Forgetting and Intransigence".

    ``since="learned"`` keeps the older variant: the maximum runs over ``l = j..T-1`` only, the
    rows from the moment task ``j`` was trained.

    Worked example, T = 3, rows after tasks 1, 2, 3 (row 0 omitted)::

        after 1: [0.9, 0.6, 0.0]
        after 2: [0.5, 0.4, 0.1]
        after 3: [0.2, 0.1, 0.8]

    Task 1: max(0.9, 0.5) - 0.2 = 0.7 under both. Task 2: ``"any"`` takes max(0.6, 0.4) - 0.1 =
    0.5 (its zero-shot peak after task 1); ``"learned"`` takes 0.4 - 0.1 = 0.3. So ``F`` is 0.6
    against 0.5.

    Sign: each ``f_j`` is the best of the checkpoints minus the final accuracy, so it is
    negative only when the final accuracy on task ``j`` beats every one of them; the mean is
    negative only when such gains outweigh the drops of the other tasks. Returns ``None`` when
    ``T == 1``.
    """
    T = _validate(R)
    if T == 1:
        return None
    if since not in ("any", "learned"):
        raise ValueError(f"average_forgetting: since must be 'any' or 'learned', got {since!r}")
    first = {"any": lambda j: 1, "learned": lambda j: j}[since]
    per_task = [max(_at(R, k, j) for k in range(first(j), T)) - _at(R, T, j) for j in range(1, T)]
    return _mean(per_task)


@dataclass(frozen=True)
class ProbeRetention:
    """One probe's retention: the share of its above-chance base skill still there now.

    ``retention`` is ``clip((now - chance) / (base - chance), 0, 1)``, or ``None`` when the
    base is at or below chance (nothing to retain: the probe is left out of the mean, with a
    warning); ``ratio`` is the same ratio unclipped (above 1 when the model answers more than
    the base, below 0 under chance), which a comparison between models must read, since the
    clip ties every model at or above the base; ``drop`` is the absolute ``base - now``.
    """

    name: str
    base: float
    now: float
    chance: float
    retention: float | None
    drop: float
    ratio: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_retention_detail(
    names: Sequence[str],
    base: Sequence[float],
    now: Sequence[float],
    chance: Sequence[float] | None = None,
) -> list[ProbeRetention]:
    """Per-probe retention (see :class:`ProbeRetention`); ``chance`` defaults to 0 for all,
    the chance level of a generation probe (``1 / k`` for a ``k``-choice probe)."""
    chance = [0.0] * len(base) if chance is None else chance
    if not len(names) == len(base) == len(now) == len(chance):
        raise ValueError(
            f"probe_retention needs one name, base, current and chance value per probe: got "
            f"{len(names)}, {len(base)}, {len(now)} and {len(chance)}"
        )
    out = []
    for name, b, n, c in zip(names, base, now, chance, strict=True):
        b, n, c = float(b), float(n), float(c)
        ratio = None if b <= c else (n - c) / (b - c)
        kept = None if ratio is None else min(1.0, max(0.0, ratio))
        out.append(ProbeRetention(name, b, n, c, kept, b - n, ratio))
    return out


def probe_retention(
    base: Sequence[float], now: Sequence[float], chance: Sequence[float] | None = None
) -> float | None:
    """Mean retention over the probes whose base score is above chance.

    Formula: per probe ``r_k = clip((now[k] - c_k) / (base[k] - c_k), 0, 1)`` with ``c_k`` the
    chance level (0 for generation, ``1 / k`` for ``k``-choice), then the mean of ``r_k`` over
    the probes with ``base[k] > c_k``. Bounded in [0, 1]: 1 means every such probe is at or
    above its base score, 0 that all are back at chance. Returns ``None`` when no probe is
    above chance at the base; :func:`probe_retention_detail` names the ones left out.
    """
    names = [str(k) for k in range(len(base))]
    kept = [p.retention for p in probe_retention_detail(names, base, now, chance)]
    usable = [r for r in kept if r is not None]
    return _mean(usable) if usable else None


def probe_retention_unclipped(
    base: Sequence[float], now: Sequence[float], chance: Sequence[float] | None = None
) -> float | None:
    """:func:`probe_retention` without the clip: the mean over the probes above chance at the
    base of ``(now[k] - c_k) / (base[k] - c_k)``, above 1 when the model gains. What tells two
    models apart that both score at or above the base."""
    names = [str(k) for k in range(len(base))]
    ratios = [p.ratio for p in probe_retention_detail(names, base, now, chance)]
    usable = [r for r in ratios if r is not None]
    return _mean(usable) if usable else None


def token_kl(logp_p: Tensor, logp_q: Tensor, mask: Tensor) -> Tensor:
    """Mean per-position ``KL(p || q)`` over the positions selected by ``mask``.

    Formula: at each position ``KL = sum_v exp(logp_p[v]) * (logp_p[v] - logp_q[v])`` over the
    last (vocabulary) dimension, then averaged over positions where ``mask`` is true.

    ``logp_p`` and ``logp_q`` are log-probabilities (e.g. ``log_softmax`` outputs) of shape
    ``(..., V)``; ``mask`` has shape ``(...)``. Entries with ``p == 0`` (``logp_p == -inf``)
    contribute 0; unmasked positions are ignored even if they hold non-finite values. The
    result is a 0-dim float tensor (float32 or wider), always ``>= 0`` up to rounding; it is
    ``inf`` if ``q == 0`` somewhere ``p > 0``. Raises ``ValueError`` on mismatched shapes or
    when ``mask`` selects no position.

    Used for the KL-drift metric: with teacher forcing on the probes' reference completions,
    ``token_kl(base, model, mask)`` gives ``KL(p_base || p_model)`` and
    ``token_kl(model, base, mask)`` gives ``KL(p_model || p_base)``.
    """
    if logp_p.shape != logp_q.shape:
        raise ValueError(
            f"logp_p and logp_q must have the same shape; got {tuple(logp_p.shape)} "
            f"and {tuple(logp_q.shape)}"
        )
    if logp_p.dim() < 1 or mask.shape != logp_p.shape[:-1]:
        raise ValueError(
            f"mask must have the shape of the log-probabilities without the last dim; got mask "
            f"{tuple(mask.shape)} for log-probabilities {tuple(logp_p.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(logp_p.dtype, logp_q.dtype), torch.float32)
    keep = mask.to(torch.bool)
    if not bool(keep.any()):
        raise ValueError("token_kl: mask selects no positions")
    lp = logp_p[keep].to(dtype)  # (N, V): only the selected positions
    lq = logp_q[keep].to(dtype)
    p = lp.exp()
    # Zero the log-ratio where p == 0 so that 0 * (-inf - x) becomes 0, not NaN (this also
    # keeps gradients finite there).
    log_ratio = torch.where(p > 0, lp - lq, torch.zeros((), dtype=dtype, device=lp.device))
    return (p * log_ratio).sum(dim=-1).mean()


RUN_METRICS = (
    "average_accuracy",
    "bwt",
    "fwt",
    "forgetting",
    "gain",
    "retention",
    "retention_unclipped",
    "kl_drift",
)
"""The run-level metrics, in the order a bench aggregates and a report prints them: those of
:func:`summarize`, then the probes' KL to the base."""


def summarize(
    R: Matrix,
    probe_base: Sequence[float],
    probe_now: Sequence[float],
    probe_chance: Sequence[float] | None = None,
) -> dict[str, float | None]:
    """All accuracy-matrix and probe metrics in one dict.

    Keys: ``average_accuracy``, ``bwt`` (:func:`backward_transfer`), ``fwt``
    (:func:`forward_transfer`), ``forgetting`` (:func:`average_forgetting`), ``gain``
    (:func:`plasticity_gain`), ``retention`` (:func:`probe_retention`), ``retention_unclipped``
    (:func:`probe_retention_unclipped`). Values that are undefined (single task, no usable
    probes) are ``None``. Sources: see each function.
    """
    return {
        "average_accuracy": average_accuracy(R),
        "bwt": backward_transfer(R),
        "fwt": forward_transfer(R),
        "forgetting": average_forgetting(R),
        "gain": plasticity_gain(R),
        "retention": probe_retention(probe_base, probe_now, probe_chance),
        "retention_unclipped": probe_retention_unclipped(probe_base, probe_now, probe_chance),
    }
