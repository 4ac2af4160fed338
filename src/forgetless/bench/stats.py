"""Means with 95% Student-t intervals, and whether two intervals separate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
_T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n}

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.mean:.3f}"
        return f"{self.mean:.3f} ± {(self.high - self.low) / 2:.3f}"


def t_quantile(df: int) -> float:
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_interval(values: Sequence[float]) -> Interval | None:
    """Mean and 95% t-interval of ``values`` (zero width for one value; None if empty)."""
    clean = [v for v in values if v is not None and math.isfinite(v)]
    if not clean:
        return None
    mean = sum(clean) / len(clean)
    if len(clean) < 2:
        return Interval(mean, mean, mean, 1)
    sd = math.sqrt(sum((v - mean) ** 2 for v in clean) / (len(clean) - 1))
    half = t_quantile(len(clean) - 1) * sd / math.sqrt(len(clean))
    return Interval(mean, mean - half, mean + half, len(clean))


MIN_SEEDS = 3
"""The fewest seeds a verdict rests on: below it, a difference is exploratory."""


def separated(a: Interval | None, b: Interval | None) -> bool:
    """True when both intervals rest on at least ``MIN_SEEDS`` runs and do not overlap."""
    if a is None or b is None or a.n < MIN_SEEDS or b.n < MIN_SEEDS:
        return False
    return a.high < b.low or b.high < a.low


def paired_verdict(diffs: Sequence[float], expected: int = 1, untestable: bool = False) -> str:
    """The house rule for a claim measured as per-seed paired differences (arm − control).

    ``expected`` is the sign the claim predicts. "supported" or "refuted" only where the 95%
    interval of the differences excludes zero (in the predicted direction, or against it);
    "inconclusive" where it holds zero; "exploratory" on fewer than ``MIN_SEEDS`` seeds; "not
    testable here" when the test bed cannot show the effect (both arms at floor or ceiling,
    ``untestable``).
    """
    if untestable:
        return "not testable here"
    found = mean_interval(diffs)
    if found is None:
        return "not measured"
    return interval_verdict((found.low, found.high), found.n, expected)


def interval_verdict(interval: Sequence[float] | None, runs: int, expected: int = 1) -> str:
    """The house rule for an estimate given with its own 95% interval (a correlation inside
    runs, say): "supported" or "refuted" only where ``interval`` excludes zero, "inconclusive"
    where it holds it, "exploratory" on fewer than ``MIN_SEEDS`` runs."""
    if runs < MIN_SEEDS:
        return "exploratory"
    if interval is None:
        return "not measured"
    low, high = interval
    if low > 0 or high < 0:
        return "supported" if (low > 0) == (expected > 0) else "refuted"
    return "inconclusive"


def at_bound(*arms: Sequence[float], low: float = 0.0, high: float = 1.0) -> bool:
    """True when every arm sits at the floor, or every arm at the ceiling, in every run."""
    values = [v for arm in arms for v in arm]
    return bool(values) and (all(v <= low for v in values) or all(v >= high for v in values))
