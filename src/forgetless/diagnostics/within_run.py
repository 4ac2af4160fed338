"""A signal's correlation with forgetting inside runs: run and position fixed effects.

A per-run correlation needs several tasks a run; a short sequence gives too few points for one.
The fixed-effects form uses every point yet compares a run only with itself: each value has its
run's mean and its task position's mean taken out (alternating projections, so runs that miss a
position still count), and the correlation of what remains is the within-run association net of
position. This is the two-way fixed-effects estimator of panel data (Wooldridge, *Econometric
Analysis of Cross Section and Panel Data*, ch. 10), with the run as the panel unit.

Its interval leaves out one whole run at a time (a delete-one-cluster jackknife, on Fisher's z,
with Student's t at runs − 1 degrees of freedom), because a run's points are not independent
draws. A percentile bootstrap over runs, tried first, was too narrow with a dozen runs; the
jackknife holds its level (``tests/unit/test_within_run.py``: 12 of 300 simulated panels with
no association inside runs exclude zero).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from forgetless.bench.stats import t_quantile

Point = tuple[str, int, float, float]
"""(run, task position, signal, target)."""
Item = TypeVar("Item")


def two_way_residuals(points: Sequence[Point], sweeps: int = 100) -> list[tuple[float, float]]:
    """Each point's signal and target less its run's and its position's effect."""
    xs = [p[2] for p in points]
    ys = [p[3] for p in points]
    groupings: list[list[object]] = [[p[0] for p in points], [p[1] for p in points]]
    for _ in range(sweeps):
        shift = 0.0
        for groups in groupings:
            for values in (xs, ys):
                shift = max(shift, _demean(values, groups))
        if shift < 1e-12:
            break
    return list(zip(xs, ys, strict=True))


def _demean(values: list[float], groups: Sequence[object]) -> float:
    """Subtract each group's mean in place; return the largest mean taken out."""
    sums: dict[object, list[float]] = {}
    for value, group in zip(values, groups, strict=True):
        sums.setdefault(group, []).append(value)
    means = {g: statistics.fmean(v) for g, v in sums.items()}
    for i, group in enumerate(groups):
        values[i] -= means[group]
    return max((abs(m) for m in means.values()), default=0.0)


def residual_correlation(points: Sequence[Point]) -> float | None:
    """Pearson's r of the two-way residuals; None where either has no spread left."""
    pairs = two_way_residuals(points)
    sxx = sum(x * x for x, _ in pairs)
    syy = sum(y * y for _, y in pairs)
    if sxx <= 1e-18 or syy <= 1e-18:
        return None
    return max(-1.0, min(1.0, sum(x * y for x, y in pairs) / math.sqrt(sxx * syy)))


def jackknife_interval(
    estimate: float, left_out: Sequence[float], z_scale: bool
) -> list[float] | None:
    """A 95% interval from the leave-one-run-out values (on Fisher's z when ``z_scale``);
    None for fewer than three runs."""
    runs = len(left_out)
    if runs < 3:
        return None
    scale = (lambda r: math.atanh(max(-0.999999, min(0.999999, r)))) if z_scale else float
    back = math.tanh if z_scale else float
    values = [scale(v) for v in left_out]
    mean = statistics.fmean(values)
    spread = math.sqrt((runs - 1) / runs * sum((v - mean) ** 2 for v in values))
    half = t_quantile(runs - 1) * spread
    return [back(scale(estimate) - half), back(scale(estimate) + half)]


def _points(rows: Sequence[dict[str, Any]], signal: str, target: str) -> list[Point]:
    return [
        (str(r["run"]), int(r["task_index"]), float(r[signal]), float(r[target]))
        for r in rows
        if r.get(signal) is not None and r.get(target) is not None
    ]


def jackknifed(
    statistic: Callable[[Sequence[Item]], float | None],
    items: Sequence[Item],
    run_of: Callable[[Item], str],
    z_scale: bool,
) -> tuple[float | None, list[float] | None, int]:
    """``statistic`` on all ``items``, its jackknife interval over runs (None where the
    statistic is undefined on all or on any leave-one-run-out subset) and the number of runs."""
    runs = sorted({run_of(item) for item in items})
    estimate = statistic(items)
    left_out = [statistic([i for i in items if run_of(i) != run]) for run in runs]
    kept = [v for v in left_out if v is not None]
    interval = None
    if estimate is not None and len(kept) == len(left_out):
        interval = jackknife_interval(estimate, kept, z_scale)
    return estimate, interval, len(runs)


def within_run(
    rows: Sequence[dict[str, Any]], signals: Sequence[str], target: str
) -> dict[str, dict[str, Any]]:
    """Each signal's fixed-effects correlation with ``target`` over the rows where both are
    defined, with its 95% jackknife interval over runs."""
    out: dict[str, dict[str, Any]] = {}
    for signal in signals:
        points = _points(rows, signal, target)
        r, interval, runs = jackknifed(residual_correlation, points, lambda p: p[0], True)
        out[signal] = {"r": r, "points": len(points), "runs": runs, "ci95": interval}
    return out


def contrast(rows: Sequence[dict[str, Any]], a: str, b: str, target: str) -> dict[str, Any]:
    """|r a| − |r b| over the runs where both signals are defined, with its jackknife
    interval: does ``a`` predict ``target`` more strongly than ``b`` inside runs?"""
    both = [r for r in rows if r.get(a) is not None and r.get(b) is not None]

    def gap(subset: Sequence[dict[str, Any]]) -> float | None:
        ra = residual_correlation(_points(subset, a, target))
        rb = residual_correlation(_points(subset, b, target))
        return None if ra is None or rb is None else abs(ra) - abs(rb)

    diff, interval, runs = jackknifed(gap, both, lambda r: str(r["run"]), False)
    return {"diff": diff, "runs": runs, "ci95": interval}
