"""The within-run correlation: run and position fixed effects, runs resampled whole."""

from __future__ import annotations

import random
import statistics

import pytest

from forgetless.diagnostics.diagnose_geometry import pearson
from forgetless.diagnostics.within_run import contrast, two_way_residuals, within_run


def panel(
    slope: float, run_effect: float, position_effect: float, runs: int = 12, seed: int = 1
) -> list[dict]:
    """Three positions a run, as a four-task sequence gives. Each run's level moves the signal
    and the target together by ``run_effect``; each position moves both by
    ``position_effect``; inside a run the target follows the signal with ``slope``."""
    rng = random.Random(seed)
    rows = []
    for r in range(runs):
        level = rng.gauss(0, 1)
        for t in (2, 3, 4):
            own = rng.gauss(0, 1)
            signal = own + 3 * level + position_effect * t
            target = slope * own + run_effect * level + position_effect * t + rng.gauss(0, 0.3)
            rows.append({"run": f"r{r}", "task_index": t, "sig": signal, "y": target})
    return rows


def test_a_run_level_confound_does_not_reach_the_within_run_correlation() -> None:
    rows = panel(slope=-1.0, run_effect=4.0, position_effect=0.0)
    pooled = pearson([r["sig"] for r in rows], [r["y"] for r in rows])
    assert pooled is not None and pooled > 0.5  # the runs' levels dominate when pooled
    found = within_run(rows, ["sig"], "y")["sig"]
    assert found["r"] < -0.7 and found["ci95"][1] < 0
    assert (found["points"], found["runs"]) == (36, 12)


def test_a_position_effect_alone_leaves_no_correlation() -> None:
    rows = panel(slope=0.0, run_effect=0.0, position_effect=3.0)
    pooled = pearson([r["sig"] for r in rows], [r["y"] for r in rows])
    assert pooled is not None and pooled > 0.5
    low, high = within_run(rows, ["sig"], "y")["sig"]["ci95"]
    assert low < 0 < high


def test_residuals_have_no_run_or_position_mean_left_in_an_unbalanced_panel() -> None:
    rows = panel(slope=-1.0, run_effect=2.0, position_effect=1.0, runs=5)[:-1]  # r4 lacks t=4
    points = [(r["run"], r["task_index"], r["sig"], r["y"]) for r in rows]
    residuals = two_way_residuals(points)
    for index in (0, 1):
        groups: dict[object, list[float]] = {}
        for point, (x, _) in zip(points, residuals, strict=True):
            groups.setdefault(point[index], []).append(x)
        assert all(abs(statistics.fmean(v)) < 1e-9 for v in groups.values())


def test_two_signals_are_compared_run_by_run() -> None:
    rows = panel(slope=-1.0, run_effect=0.0, position_effect=0.0)
    for row in rows:
        row["noise"] = random.Random(f"{row['run']}-{row['task_index']}").gauss(0, 1)
    found = within_run(rows, ["sig", "noise"], "y")
    compared = contrast(rows, "sig", "noise", "y")
    assert compared["diff"] == pytest.approx(abs(found["sig"]["r"]) - abs(found["noise"]["r"]))
    assert compared["ci95"][0] > 0 and compared["runs"] == 12
    two_runs = [r for r in rows if r["run"] in ("r0", "r1")]
    assert within_run(two_runs, ["sig"], "y")["sig"]["ci95"] is None  # too few runs


def test_the_interval_holds_its_level_where_there_is_no_association() -> None:
    """300 panels of 12 runs, three points each, position and run effects but nothing inside
    runs: a 95% interval should exclude zero in about one panel in twenty (12 of 300 here)."""
    excluded = 0
    for seed in range(300):
        low, high = within_run(panel(0.0, 1.0, 3.0, seed=seed), ["sig"], "y")["sig"]["ci95"]
        excluded += not low < 0 < high
    assert excluded <= 21  # 7%
