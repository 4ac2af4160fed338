"""The geometry claims (docs/claims.md) from ``forgetless diagnose geometry`` files.

A block ``<!-- geometry-claims: DIR -->`` … ``<!-- /geometry-claims -->`` is filled with one row
per claim and method, from ``studies/results/DIR/geometry-<method>.json`` (one diagnosis over
all of that method's runs: seeds × task orders). The unit is the run: each run gives one Spearman
correlation between a signal and the change in log-likelihood of the tasks still retained
(``retention_change_loglik``), after each task position's mean over the runs is taken out
(``run_level_position_controlled``). A claim that a signal predicts forgetting expects a negative
correlation (a larger signal, a larger loss); a claim that one signal predicts better than
another compares the size of the two correlations run by run. Verdicts follow the house rule
(``paired_verdict``): the 95% interval over runs must exclude zero.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from claims_table import fmt_interval, interval_cell

from forgetless.bench.stats import interval_verdict, paired_verdict

SIGNAL_LABELS = {
    "state_conflict": "state conflict",
    "pairwise_conflict": "pairwise conflict",
    "update_norm": "update norm",
    "sar": "SAR",
}
PREDICTS = ("state_conflict", "update_norm", "pairwise_conflict", "sar")
BEATS = ("update_norm", "pairwise_conflict", "sar")
SOURCE = "Geometry Conflict paper"


def _per_run(data: dict[str, Any], signal: str, key: str) -> dict[str, float]:
    return dict((data.get(key) or {}).get(signal, {}).get("per_run") or {})


def claim_rows(method: str, data: dict[str, Any]) -> list[str]:
    """The rows of one method's diagnosis."""
    rows = []
    controlled = "run_level_position_controlled"
    for signal in PREDICTS:
        rhos = list(_per_run(data, signal, controlled).values())
        raw = list(_per_run(data, signal, "run_level").values())
        label = SIGNAL_LABELS[signal]
        claim = f"{label[0].upper() + label[1:]} predicts the loss of still-retained tasks"
        measured = (
            f"Spearman per run, position controlled: {interval_cell(rhos)} ({len(rhos)} runs); "
            f"without the control {interval_cell(raw)}"
        )
        verdict = paired_verdict(rhos, expected=-1)
        rows.append(f"| {claim} | `{method}` | {SOURCE} | {measured} | **{verdict}** |")
    state = _per_run(data, "state_conflict", controlled)
    for other in BEATS:
        theirs = _per_run(data, other, controlled)
        runs = sorted(set(state) & set(theirs))
        diffs = [abs(state[r]) - abs(theirs[r]) for r in runs]
        claim = f"State conflict predicts it better than {SIGNAL_LABELS[other]}"
        measured = f"\\|ρ state\\| − \\|ρ {SIGNAL_LABELS[other]}\\| per run: {interval_cell(diffs)}"
        measured += f" ({len(diffs)} runs)"
        verdict = paired_verdict(diffs, expected=1)
        rows.append(f"| {claim} | `{method}` | {SOURCE} | {measured} | **{verdict}** |")
    return rows


def _num(value: float) -> str:
    return fmt_interval(value, 0.0, 1)


def _estimate(value: float | None, interval: list[float] | None) -> str:
    if value is None:
        return "n/a"
    if interval is None:
        return _num(value)
    return f"{_num(value)}, 95% interval [{_num(interval[0])}, {_num(interval[1])}]"


def within_rows(data: dict[str, Any]) -> list[str]:
    """The rows of a diagnosis's ``within_run`` part: each signal's correlation with the loss
    inside runs (run and position fixed effects), and state conflict against the others."""
    within = data["within_run"]
    methods = sorted({run.split("/")[0] for run in data["runs"]})
    arms = f"every kept run ({', '.join(f'`{m}`' for m in methods)})"
    rows = []
    for signal in PREDICTS:
        found = within["signals"][signal]
        label = SIGNAL_LABELS[signal]
        claim = f"{label[0].upper() + label[1:]} predicts the loss of still-retained tasks"
        measured = (
            f"r inside runs, run and position fixed effects: "
            f"{_estimate(found['r'], found['ci95'])} ({found['points']} points, "
            f"{found['runs']} runs)"
        )
        verdict = interval_verdict(found["ci95"], found["runs"], expected=-1)
        rows.append(f"| {claim} | {arms} | {SOURCE} | {measured} | **{verdict}** |")
    for other in BEATS:
        found = within["state_conflict_minus"][other]
        claim = f"State conflict predicts it better than {SIGNAL_LABELS[other]}"
        measured = (
            f"\\|r state\\| − \\|r {SIGNAL_LABELS[other]}\\| inside runs: "
            f"{_estimate(found['diff'], found['ci95'])} ({found['runs']} runs)"
        )
        verdict = interval_verdict(found["ci95"], found["runs"], expected=1)
        rows.append(f"| {claim} | {arms} | {SOURCE} | {measured} | **{verdict}** |")
    return rows


def render_geometry_within(path: Path) -> str:
    """The table of one ``studies/real_geometry.py`` file (not measured while absent)."""
    lines = ["| claim | runs | source | measured | verdict |", "|---|---|---|---|---|"]
    if not path.is_file():
        lines.append(f"| (`{path.name}` not kept yet) | | | | **not measured** |")
    else:
        lines.extend(within_rows(json.loads(path.read_text(encoding="utf-8"))))
    return "\n".join(lines) + "\n"


def render_geometry(folder: Path) -> str:
    """The table for every ``geometry-<method>.json`` under ``folder``."""
    lines = ["| claim | method | source | measured | verdict |", "|---|---|---|---|---|"]
    files = sorted(folder.glob("geometry-*.json"))
    for path in files:
        method = path.stem.removeprefix("geometry-")
        lines.extend(claim_rows(method, json.loads(path.read_text(encoding="utf-8"))))
    if not files:
        lines.append("| (no diagnosis kept yet) | | | | **not measured** |")
    return "\n".join(lines) + "\n"
