"""The forgetting budget's three claims, rendered from its campaign (issue 23).

``benchmarks/budget_claims.yaml`` pairs each budgeted variant of ``configs/claims-budget.yaml``
with its grid of fixed strengths and its plain run. For each arm, over the kept seeds:

- (a) the share of runs that kept the budget at the end of every task, on the full evaluation
  probes (``metrics.budget.kept_every_task``): supported at ≥ 90% of at least 3 runs;
- (b) new-task gain against the oracle, the grid value with the highest mean gain among those
  that kept the budget in every seed: the per-seed paired difference (arm − oracle) is
  non-inferior where its 95% interval's lower bound is above −0.03, inferior where the upper
  bound is below it, inconclusive otherwise (one seed: exploratory; no grid value keeps the
  budget: no oracle);
- (c) the controller's overhead: the median over seeds of the arm's training time over its plain
  run's (the same method at its configured strength, no budget), against ≤ 1.15×.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import yaml

from forgetless.bench.stats import mean_interval

SPEC = Path(__file__).parent / "budget_claims.yaml"
MARGIN, KEPT_SHARE, OVERHEAD = -0.03, 0.9, 1.15
Runs = dict[tuple[str, int], dict[str, Any]]


def kept(run: dict[str, Any]) -> bool:
    return bool((run["metrics"].get("budget") or {}).get("kept_every_task"))


def oracle(grid: list[str], runs: Runs, seeds: list[int]) -> str | None:
    """The value of ``grid`` (those that kept the budget) with the best mean gain over
    ``seeds``, among those run in every one of them."""
    return max(
        (g for g in grid if all((g, s) in runs for s in seeds)),
        key=lambda g: statistics.mean(runs[(g, s)]["metrics"]["gain"] for s in seeds),
        default=None,
    )


def keeps(run: dict[str, Any], max_loss: float) -> bool:
    """A fixed-strength run kept ``max_loss`` of retention at the end of the sequence (a run
    without a budget records no per-task check: judged at the end only, which favours the
    oracle, so the comparison is conservative)."""
    retention = run["metrics"].get("retention")
    return retention is not None and 1.0 - retention <= max_loss


def arm_row(arm: dict[str, Any], runs: Runs, seeds: list[int]) -> dict[str, str]:
    name, max_loss = arm["budget"], float(arm["max_loss"])
    mine = [s for s in seeds if (name, s) in runs]
    row = {"arm": f"`{name}`", "runs": str(len(mine))}
    if not mine:
        return row | {"a": "not measured", "b": "not measured", "c": "not measured"}
    share = sum(kept(runs[(name, s)]) for s in mine) / len(mine)
    verdict_a = "supported" if share >= KEPT_SHARE and len(mine) >= 3 else "not supported"
    row["a"] = f"{share:.0%} kept; **{verdict_a if len(mine) > 1 else 'exploratory'}**"
    grid = [
        g for g in arm["grid"] if all(keeps(runs[(g, s)], max_loss) for s in mine if (g, s) in runs)
    ]
    best = oracle(grid, runs, mine)
    if best is None:
        row["b"] = "no grid value kept the budget: no oracle"
    else:
        diffs = [
            runs[(name, s)]["metrics"]["gain"] - runs[(best, s)]["metrics"]["gain"] for s in mine
        ]
        found = mean_interval(diffs)
        assert found is not None
        if found.n < 2:
            verdict = "exploratory"
        elif found.low > MARGIN:
            verdict = "non-inferior"
        elif found.high < MARGIN:
            verdict = "inferior"
        else:
            verdict = "inconclusive"
        half = (found.high - found.low) / 2
        row["b"] = f"vs `{best}`: {found.mean:+.3f} ± {half:.3f}; **{verdict}**"
    plain = [s for s in mine if (arm["plain"], s) in runs]
    if plain:
        ratio = statistics.median(
            runs[(name, s)]["train_seconds"] / runs[(arm["plain"], s)]["train_seconds"]
            for s in plain
        )
        row["c"] = f"{ratio:.2f}× `{arm['plain']}`; **{'met' if ratio <= OVERHEAD else 'not met'}**"
    else:
        row["c"] = "no plain run kept"
    return row


def render_budget(runs: Runs, seeds: list[int], spec: Path = SPEC) -> str:
    arms = yaml.safe_load(spec.read_text(encoding="utf-8"))["arms"]
    lines = [
        "| arm | runs | (a) budget kept, every task | (b) gain vs the best fixed strength "
        "that keeps it (paired) | (c) time vs a plain run |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        row = arm_row(arm, runs, seeds)
        cells = [row["arm"], row["runs"], row.get("a", ""), row.get("b", ""), row.get("c", "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
