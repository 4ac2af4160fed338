"""A forgetting gate: how much of a base model's above-chance skill a model keeps on probes, with
a paired bootstrap interval over the probe items, and a verdict at a declared confidence.

The statistic (``forgetless check``, docs/guide.md "A forgetting gate in CI"):

* per probe ``k``, retention ``r_k = (now_k - c_k) / (base_k - c_k)``, unclipped (above 1 when
  the model beats the base, below 0 under chance), ``c_k`` the probe's chance score; overall
  retention ``R`` is the mean of ``r_k`` over the probes where the base is above chance, and the
  loss is ``1 - R``;
* the paired bootstrap: each resample draws every probe's items with replacement, the same items
  for the base and the model (they answered the same questions), and recomputes ``R``; a probe
  whose resampled base falls to chance counts as kept nothing (``r_k = 0``, the cautious side);
* the verdict: pass when the ``confidence`` quantile of the resampled loss (a one-sided upper
  bound) is at most ``max_loss``. A model equal to the base always passes (every resample is 0).

The noise floor is the same loss between the base and itself scored on two independent draws of
its items: how far two evaluations of one model on this many items disagree. Below it, only the
pairing lets a gate resolve a loss; with unpaired runs, more items are needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from torch import nn

from forgetless.config.schema import EvalConfig
from forgetless.errors import DataError
from forgetless.eval.evaluator import Evaluator
from forgetless.tasks.base import Task

DEFAULT_REPEATS = 2000
QUIET_EVAL = EvalConfig(kl_drift=False, loglik_examples=0)
"""The Evaluator's settings when none are given: the probes' verdicts only."""


@dataclass(frozen=True)
class ProbeItems:
    """One probe's per-item verdicts for the base and the model (the same items, in order)."""

    name: str
    base: Sequence[bool]
    model: Sequence[bool]
    chance: float = 0.0

    def __post_init__(self) -> None:
        if len(self.base) != len(self.model) or not self.base:
            raise ValueError(
                f"probe {self.name!r}: the base and the model need the same, non-empty items "
                f"(got {len(self.base)} and {len(self.model)})"
            )


@dataclass(frozen=True)
class ProbeGate:
    """One probe's scores, retention and one-sided ``confidence`` bounds on it."""

    name: str
    items: int
    chance: float
    base: float
    model: float
    retention: float | None
    """None when the base is at or below chance: nothing to retain, the probe is left out."""
    low: float | None = None
    high: float | None = None


@dataclass(frozen=True)
class GateVerdict:
    """The gate's answer: overall retention with its bounds, the loss and whether it passes."""

    probes: list[ProbeGate]
    retention: float
    low: float
    """The one-sided lower bound on retention at ``confidence``."""
    high: float
    """The one-sided upper bound on retention at ``confidence``."""
    loss: float
    loss_bound: float
    """``1 - low``: the one-sided upper bound on the loss the verdict compares with max_loss."""
    max_loss: float
    confidence: float
    repeats: int
    noise_floor: float
    passed: bool
    prose: dict[str, float] = field(default_factory=dict)
    """The model's perplexity and KL(base || model) per token on the held-out prose, if measured."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def above_chance_ratio(base: float, now: float, chance: float) -> float | None:
    """``(now - chance) / (base - chance)``, unclipped; None when the base is at or below chance."""
    if base <= chance:
        return None
    return (now - chance) / (base - chance)


def _resampled_accuracy(verdicts: np.ndarray, draws: np.ndarray) -> np.ndarray:
    return verdicts[draws].mean(axis=1)


def _ratio(base: np.ndarray, now: np.ndarray, chance: float) -> np.ndarray:
    """Per resample ratio; a resample where the base is at chance keeps nothing (0)."""
    above = base - chance
    safe = np.where(above > 0, above, 1.0)
    return np.where(above > 0, (now - chance) / safe, 0.0)


def paired_bootstrap(
    probes: Sequence[ProbeItems], repeats: int, rng: np.random.Generator
) -> np.ndarray:
    """Overall retention of ``repeats`` paired resamples (shape ``(repeats,)``): per probe, one
    draw of item indices with replacement serves the base and the model alike."""
    per_probe = []
    for probe in probes:
        base, model = np.asarray(probe.base, dtype=float), np.asarray(probe.model, dtype=float)
        draws = rng.integers(0, len(base), size=(repeats, len(base)))
        acc_base, acc_model = _resampled_accuracy(base, draws), _resampled_accuracy(model, draws)
        per_probe.append(_ratio(acc_base, acc_model, probe.chance))
    return np.mean(per_probe, axis=0)


def noise_floor(
    probes: Sequence[ProbeItems], repeats: int, confidence: float, rng: np.random.Generator
) -> float:
    """The ``confidence`` quantile of the loss between the base and itself on two independent
    draws of its items (the spread of one model's score over the items it happens to get)."""
    per_probe = []
    for probe in probes:
        base = np.asarray(probe.base, dtype=float)
        first = _resampled_accuracy(base, rng.integers(0, len(base), size=(repeats, len(base))))
        second = _resampled_accuracy(base, rng.integers(0, len(base), size=(repeats, len(base))))
        per_probe.append(_ratio(first, second, probe.chance))
    return float(np.quantile(1.0 - np.mean(per_probe, axis=0), confidence))


def _probe_gate(probe: ProbeItems, retention: float | None, bounds: np.ndarray | None) -> ProbeGate:
    base, model = float(np.mean(probe.base)), float(np.mean(probe.model))
    low, high = (None, None) if bounds is None else (float(bounds[0]), float(bounds[1]))
    return ProbeGate(probe.name, len(probe.base), probe.chance, base, model, retention, low, high)


def gate(
    probes: Sequence[ProbeItems],
    max_loss: float,
    confidence: float = 0.95,
    repeats: int = DEFAULT_REPEATS,
    seed: int = 0,
) -> GateVerdict:
    """Retention of ``probes``, its paired bootstrap bounds and the verdict (module docstring).

    Raises DataError when no probe has its base above chance (there is nothing to keep).
    """
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence}")
    points = {
        p.name: above_chance_ratio(float(np.mean(p.base)), float(np.mean(p.model)), p.chance)
        for p in probes
    }
    usable = [p for p in probes if points[p.name] is not None]
    if not usable:
        raise DataError("no probe has the base above chance: there is nothing to retain")
    rng = np.random.default_rng(seed)
    quantiles = [1.0 - confidence, confidence]
    gated = []
    for probe in probes:
        kept = points[probe.name]
        bounds = None
        if kept is not None:
            bounds = np.quantile(paired_bootstrap([probe], repeats, rng), quantiles)
        gated.append(_probe_gate(probe, kept, bounds))
    resampled = paired_bootstrap(usable, repeats, rng)
    retention = math.fsum(points[p.name] or 0.0 for p in usable) / len(usable)
    low, high = (float(q) for q in np.quantile(resampled, quantiles))
    return GateVerdict(
        probes=gated,
        retention=retention,
        low=low,
        high=high,
        loss=1.0 - retention,
        loss_bound=1.0 - low,
        max_loss=max_loss,
        confidence=confidence,
        repeats=repeats,
        noise_floor=noise_floor(usable, repeats, confidence, rng),
        passed=1.0 - low <= max_loss,
    )


def check_model(
    model: nn.Module,
    base: nn.Module,
    tokenizer: Any,
    probes: Sequence[Task],
    max_loss: float,
    confidence: float = 0.95,
    repeats: int = DEFAULT_REPEATS,
    seed: int = 0,
    settings: EvalConfig | None = None,
) -> GateVerdict:
    """Score ``model`` and ``base`` on ``probes`` with the Evaluator (and on the prose when
    ``settings.prose``), then :func:`gate` their per-item verdicts."""
    evaluator = Evaluator(probes, tokenizer, settings=settings or QUIET_EVAL)
    evaluator.measure_base(base, score=True)
    assert evaluator.base_row is not None
    row = evaluator.score(model)
    items = [
        ProbeItems(
            task.name,
            evaluator.base_row.results[task.name].correct,
            row.results[task.name].correct,
            row.chance[task.name],
        )
        for task in probes
    ]
    verdict = gate(items, max_loss, confidence, repeats, seed)
    if row.prose is not None:
        verdict.prose.update(row.prose)
    return verdict
