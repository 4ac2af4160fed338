"""A campaign's variants on the learning-against-keeping plane, as a table and a figure.

A frontier block in a document,

    <!-- frontier-table: claims-anchored.yaml -->
    <!-- /frontier-table -->

is filled by ``render_tables.py`` with one row per variant of the campaign's kept runs: mean and
95% interval of the new-task gain, the probe retention, the average accuracy and BWT, and
whether the variant is on the Pareto front of (retention, gain) means. ``figure`` draws the same
points with their intervals (``forgetless.report.plots.tradeoff``) for ``docs/figures/``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from claims_table import fmt_interval

from forgetless.bench.stats import mean_interval
from forgetless.report.plots import pareto_front, tradeoff

Runs = dict[tuple[str, int], dict[str, Any]]
Metric = Callable[[dict[str, Any], str], float | None]
COLUMNS = [
    ("gain", "gain"),
    ("retention", "probe retention (unclipped)"),
    ("average_accuracy", "avg acc"),
    ("bwt", "BWT"),
]


def _stats(values: list[float]) -> dict[str, float] | None:
    found = mean_interval(values)
    if found is None:
        return None
    return {"mean": found.mean, "low": found.low, "high": found.high, "n": found.n}


def frontier_rows(
    variants: list[str], seeds: list[int], runs: Runs, metric: Metric
) -> list[dict[str, Any]]:
    """Per variant with kept runs: its name, run count and each column's interval."""
    rows = []
    for name in variants:
        mine = [runs[(name, s)] for s in seeds if (name, s) in runs]
        if not mine:
            continue
        row: dict[str, Any] = {"variant": name, "runs": len(mine)}
        for key, _ in COLUMNS:
            row[key] = _stats([v for r in mine if (v := metric(r, key)) is not None])
        rows.append(row)
    return rows


def _cell(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "n/a"
    return fmt_interval(stats["mean"], (stats["high"] - stats["low"]) / 2, int(stats["n"]))


def render_frontier(rows: list[dict[str, Any]]) -> str:
    """The markdown table; a variant is on the front when no other has both a higher mean gain
    and a higher mean retention."""
    usable = [r for r in rows if r["gain"] and r["retention"]]
    front = {
        usable[i]["variant"]
        for i in pareto_front([(r["retention"]["mean"], r["gain"]["mean"]) for r in usable])
    }
    headers = ["variant", "runs", *(label for _, label in COLUMNS), "on the front"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [f"`{row['variant']}`", str(row["runs"])]
        cells += [_cell(row[key]) for key, _ in COLUMNS]
        cells.append("yes" if row["variant"] in front else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def figure(rows: list[dict[str, Any]], path: Path) -> Path:
    """The rows as points with 95% intervals, the Pareto front marked."""
    return tradeoff(rows, path)
