"""Claims rows whose figures and verdicts are computed from committed raw results.

``studies/claims.yaml`` lists each claim: its words, its source, the raw data it rests on (a
bench file under ``studies/results/`` or a campaign config), the arm and the control compared
seed by seed, the metric, and the direction the claim predicts. A document holds a block

    <!-- claims-table: SECTION -->
    ...
    <!-- /claims-table -->

which ``render_tables.py`` rewrites with one row per claim of that section: the arm's and the
control's means with 95% intervals, the paired difference with its interval, the seeds, and the
verdict by ``forgetless.bench.stats.paired_verdict`` (supported or refuted only where the
interval excludes zero; fewer than three seeds: exploratory; both arms at floor or ceiling: not
testable).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from forgetless.bench.stats import at_bound, mean_interval, paired_verdict

CLAIMS = Path(__file__).parent / "claims.yaml"
Runs = dict[tuple[str, int], dict[str, Any]]
"""(variant, seed) → a run summary (``metrics`` inside)."""


def load_claims(path: Path = CLAIMS) -> list[dict[str, Any]]:
    claims: list[dict[str, Any]] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return claims


def bench_runs(results: Path, name: str) -> Runs:
    bench = json.loads((results / name).read_text(encoding="utf-8"))
    return {(r["variant"], int(r["seed"])): r for r in bench["runs"]}


def fmt_interval(mean: float, half: float, n: int, digits: int = 3) -> str:
    """A mean with the half-width of its 95% interval (the mean alone for one value)."""
    text = f"{mean:.{digits}f}".replace("-", "−")
    return text if n < 2 else f"{text} ± {half:.{digits}f}"


def interval_cell(values: list[float], digits: int = 3) -> str:
    """``values``' mean and 95% interval as a table cell ("n/a" for none)."""
    found = mean_interval(values)
    if found is None:
        return "n/a"
    return fmt_interval(found.mean, (found.high - found.low) / 2, found.n, digits)


def claim_row(
    claim: dict[str, Any], runs: Runs, metric: Callable[[dict[str, Any], str], float | None]
) -> tuple[str, str]:
    """The ``measured`` cell and the verdict of one claim on its runs."""
    arm, control, key = claim["arm"], claim["control"], claim["metric"]
    pairs = []
    for (variant, seed), run in sorted(runs.items()):
        if variant != arm or (control, seed) not in runs:
            continue
        a, b = metric(run, key), metric(runs[(control, seed)], key)
        if a is not None and b is not None:
            pairs.append((a, b))
    arms, controls = [a for a, _ in pairs], [b for _, b in pairs]
    diffs = [a - b for a, b in pairs]
    low, high = claim.get("bounds", [0.0, 1.0])
    untestable = at_bound(arms, controls, low=low, high=high)
    verdict = paired_verdict(diffs, int(claim.get("expected", 1)), untestable)
    label = claim.get("metric_label", key)
    measured = (
        f"{label}: `{arm}` {interval_cell(arms)} vs `{control}` {interval_cell(controls)}; "
        f"paired {interval_cell(diffs)} ({len(diffs)} seed{'' if len(diffs) == 1 else 's'})"
    )
    return measured, verdict


def render_section(
    section: str,
    claims: list[dict[str, Any]],
    runs_of: Callable[[dict[str, Any]], Runs],
    metric: Callable[[dict[str, Any], str], float | None],
) -> str:
    lines = ["| claim | source | measured (paired by seed) | verdict |", "|---|---|---|---|"]
    for claim in claims:
        if claim["section"] != section:
            continue
        measured, verdict = claim_row(claim, runs_of(claim), metric)
        lines.append(f"| {claim['claim']} | {claim['source']} | {measured} | **{verdict}** |")
    if len(lines) == 2:
        raise ValueError(f"claims.yaml has no claim in section {section!r}")
    return "\n".join(lines) + "\n"
