"""The declared tests of a verdicts plan (studies/plans/*.yaml), as pure functions.

Unclipped above-chance retention, a paired t-test over seeds, Holm's step-down adjustment
(Holm 1979, "A simple sequentially rejective multiple test procedure"), TOST for equivalence of
gain (Schuirmann 1987), and a two-level bootstrap that resamples seeds and then the probe items
within each seed, the same items for both arms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean, stdev

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class ProbeRun:
    """One probe in one run: chance, and each item's outcome at the base and at the end."""

    chance: float
    base: str
    now: str


def retention(probe: ProbeRun, items: Sequence[int] | None = None) -> float | None:
    """(now − chance) / (base − chance) over ``items`` (all by default), NOT clipped: above 1
    when the model answers more than the base did; None when the base is at or below chance."""
    picked = range(len(probe.now)) if items is None else items
    base = fmean(probe.base[i] == "1" for i in picked)
    now = fmean(probe.now[i] == "1" for i in picked)
    if base - probe.chance <= 0:
        return None
    return (now - probe.chance) / (base - probe.chance)


def general_retention(
    probes: Sequence[ProbeRun], draws: Sequence[Sequence[int]] | None = None
) -> float:
    """The mean unclipped retention over ``probes`` (each resampled by its ``draws``)."""
    values = [retention(p, None if draws is None else draws[k]) for k, p in enumerate(probes)]
    kept = [v for v in values if v is not None]
    return fmean(kept) if kept else float("nan")


def at_ceiling_or_floor(scores: Sequence[float], chance: float) -> bool:
    """The plan's drop rule for one probe: every score ≥ 0.98 or every score ≤ chance + 0.02."""
    return all(s >= 0.98 for s in scores) or all(s <= chance + 0.02 for s in scores)


def paired_t(diffs: Sequence[float]) -> float:
    """Two-sided p of a paired t-test that the mean difference is 0 (1.0 with no spread)."""
    if len(diffs) < 2:
        return 1.0
    spread = stdev(diffs)
    if spread == 0:
        return 1.0 if fmean(diffs) == 0 else 0.0
    t = fmean(diffs) / (spread / len(diffs) ** 0.5)
    return float(2 * stats.t.sf(abs(t), len(diffs) - 1))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values, in the order given (monotone, capped at 1)."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted = [0.0] * len(pvalues)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[index]))
        adjusted[index] = running
    return adjusted


def tost_matched(diffs: Sequence[float], margin: float, alpha: float = 0.05) -> bool:
    """Whether the mean paired difference is within ±``margin``: both one-sided t-tests reject
    at ``alpha`` (the 1 − 2α interval inside the margin)."""
    if len(diffs) < 2:
        return False
    mean, n = fmean(diffs), len(diffs)
    half = stats.t.ppf(1 - alpha, n - 1) * stdev(diffs) / n**0.5
    return -margin < mean - half and mean + half < margin


def bootstrap_interval(
    arm: Sequence[Sequence[ProbeRun]],
    control: Sequence[Sequence[ProbeRun]],
    resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float]:
    """95% percentile interval of mean(arm − control) general retention, resampling the seeds
    and, within each, every probe's items (the same draw for both arms of a seed).

    ``arm[s][k]`` is probe ``k`` of seed ``s``; a probe's items are the same questions in
    every seed and arm (the run's fixed evaluation set)."""
    rng = np.random.default_rng(seed)
    n = len(arm)
    seeds = rng.integers(0, n, size=(resamples, n))
    diff = np.zeros((resamples, n))
    per_probe_arm, per_probe_control = [], []
    for k in range(len(arm[0])):
        items = rng.integers(0, len(arm[0][k].now), size=(resamples, n, len(arm[0][k].now)))
        per_probe_arm.append(_resampled(arm, k, seeds, items))
        per_probe_control.append(_resampled(control, k, seeds, items))
    with np.errstate(all="ignore"):
        diff = np.nanmean(per_probe_arm, axis=0) - np.nanmean(per_probe_control, axis=0)
    means = np.sort(diff.mean(axis=1))
    return float(means[int(0.025 * resamples)]), float(means[int(0.975 * resamples) - 1])


def _outcomes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8) == ord("1")


def _resampled(
    runs: Sequence[Sequence[ProbeRun]], k: int, seeds: np.ndarray, items: np.ndarray
) -> np.ndarray:
    """Probe ``k``'s unclipped retention per resample and seed slot (NaN: base at chance)."""
    base = np.stack([_outcomes(r[k].base) for r in runs])[seeds[..., None], items].mean(-1)
    now = np.stack([_outcomes(r[k].now) for r in runs])[seeds[..., None], items].mean(-1)
    chance = runs[0][k].chance
    with np.errstate(all="ignore"):
        return np.where(base - chance > 0, (now - chance) / (base - chance), np.nan)
