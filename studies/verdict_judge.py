"""Judge a declared family of comparisons on kept runs, and render the verdicts page.

Only the comparisons the plan names reach a verdict line, only on its primary metric (the
unclipped above-chance retention): ``verdict_line`` refuses anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import fmean, stdev
from typing import Any

from verdict_stats import (
    ProbeRun,
    at_ceiling_or_floor,
    bootstrap_interval,
    general_retention,
    holm,
    paired_t,
    tost_matched,
)

from forgetless.bench.stats import mean_interval
from forgetless.report.plots import pareto_front

Records = dict[str, dict[str, Any]]
PRIMARY = "general_retention"


@dataclass
class Judged:
    arm: str
    control: str
    expected: int
    source: str
    metric: str = PRIMARY
    orders: dict[str, dict[str, Any]] = field(default_factory=dict)
    verdict_a: str = "not run"
    verdict: str = "not run"


def by_seed(records: Records, variant: str) -> dict[tuple[str, int], dict[str, Any]]:
    """A variant's runs keyed by (device, seed)."""
    out = {}
    for run, record in records.items():
        device, name, _ = run.split("/")
        if name == variant and "probe_items" in record["results"]:
            out[(device, int(record["summary"]["seed"]))] = record["results"]
    return out


def probe_runs(results: dict[str, Any], keep: list[str]) -> list[ProbeRun]:
    items, chance = results["probe_items"], results["probe_chance"]
    index = {p: k for k, p in enumerate(results["probes"])}
    return [ProbeRun(chance[index[p]], items[0][index[p]], items[-1][index[p]]) for p in keep]


def kept_probes(plan: dict[str, Any], records: Records) -> tuple[list[str], list[str]]:
    """The plan's probes minus those at ceiling or floor in every run (its drop rule)."""
    runs = [r["results"] for r in records.values() if "probe_items" in r["results"]]
    kept, dropped = [], []
    for probe in plan["metric"]["probes"]:
        found = [r for r in runs if probe in r["probes"]]
        if not found:
            continue
        k = found[0]["probes"].index(probe)
        scores = [
            row[k] for r in found for row in (r["probe_accuracy"][0], r["probe_accuracy"][-1])
        ]
        (dropped if at_ceiling_or_floor(scores, found[0]["probe_chance"][k]) else kept).append(
            probe
        )
    return kept, dropped


def gain(results: dict[str, Any]) -> float:
    matrix = results["accuracy_matrix"]
    return fmean(matrix[i + 1][i] for i in range(len(matrix) - 1))


def compare(plan: dict[str, Any], records: Records, arm: str, control: str) -> dict[str, Any]:
    """Paired statistics of one comparison in one order (the device with the most pairs)."""
    a, c = by_seed(records, arm), by_seed(records, control)
    pairs = sorted(set(a) & set(c))
    if not pairs:
        return {"n": 0}
    device = max({d for d, _ in pairs}, key=lambda d: sum(p[0] == d for p in pairs))
    pairs = [p for p in pairs if p[0] == device]
    keep, dropped = kept_probes(plan, records)
    arm_runs = [probe_runs(a[p], keep) for p in pairs]
    control_runs = [probe_runs(c[p], keep) for p in pairs]
    diffs = [
        general_retention(x) - general_retention(y)
        for x, y in zip(arm_runs, control_runs, strict=True)
    ]
    gain_diffs = [gain(a[p]) - gain(c[p]) for p in pairs]
    raw = [fmean(_raw_change(a[p], keep)) - fmean(_raw_change(c[p], keep)) for p in pairs]
    return {
        "n": len(pairs),
        "device": device,
        "probes": keep,
        "dropped": dropped,
        "diff": fmean(diffs),
        "sd": stdev(diffs) if len(diffs) > 1 else None,
        "raw_change_diff": fmean(raw),
        "p": paired_t(diffs),
        "bootstrap": bootstrap_interval(arm_runs, control_runs) if len(pairs) > 1 else None,
        "gain_diff": fmean(gain_diffs),
        "gain_matched": tost_matched(gain_diffs, plan["test"]["gain_margin"]),
        "untestable": _untestable(arm_runs + control_runs),
    }


def frontier_lines(plan: dict[str, Any], records: Records) -> list[str]:
    """Order A's arms by mean gain and mean general retention over their seeds, with 95%
    t-intervals and the Pareto front marked: where an arm whose gain is not matched is judged."""
    keep, _ = kept_probes(plan, records)
    rows = []
    for arm in plan["arms"]:
        runs = list(by_seed(records, arm).values())
        kept = mean_interval([general_retention(probe_runs(r, keep)) for r in runs])
        gained = mean_interval([gain(r) for r in runs])
        if kept is not None and gained is not None:
            rows.append((arm, len(runs), gained, kept))
    if not rows:
        return []
    front = set(pareto_front([(g.mean, r.mean) for _, _, g, r in rows]))
    lines = [
        "## Gain and retention, order A",
        "",
        "Each arm's mean over its measuring seeds (95% t-interval). An arm whose gain is not "
        "TOST-matched to seq_ft's is judged here: on the gain-retention front or not.",
        "",
        "| arm | seeds | gain | general retention (unclipped) | on the front |",
        "|---|---|---|---|---|",
    ]
    for index, (arm, n, g, r) in enumerate(rows):
        lines.append(f"| {arm} | {n} | {g} | {r} | {'yes' if index in front else ''} |")
    return [*lines, ""]


def _raw_change(results: dict[str, Any], keep: list[str]) -> list[float]:
    rows = results["probe_accuracy"]
    return [
        rows[-1][results["probes"].index(p)] - rows[0][results["probes"].index(p)] for p in keep
    ]


def _untestable(runs: list[list[ProbeRun]]) -> bool:
    now = [fmean(c == "1" for c in p.now) for r in runs for p in r]
    return all(v == 0 for v in now) or all(v == 1 for v in now)


def order_verdict(
    stat: dict[str, Any], expected: int, adjusted: float | None, seeds: int | None = None
) -> str:
    """The plan's verdict rules for one order; short of the plan's ``seeds`` pairs, pending."""
    if not stat.get("n") or adjusted is None:
        return "not run"
    if seeds is not None and stat["n"] < seeds:
        return f"pending ({stat['n']} of {seeds} seeds)"
    if stat["untestable"]:
        return "not testable here"
    side = 1 if stat["diff"] > 0 else -1
    low, high = stat["bootstrap"] or (0.0, 0.0)
    excludes = low > 0 if side > 0 else high < 0
    if adjusted >= 0.05 or not excludes:
        return "no difference shown"
    if not stat["gain_matched"]:
        return "frontier"
    return "retains more" if side == expected else "retains less"


def comparisons(plan: dict[str, Any], family: str = "family") -> list[dict[str, Any]]:
    """A declared family's comparisons: ``family``, or ``second_family`` (none if undeclared)."""
    if family == "family":
        return list(plan["family"])
    return list(plan.get(family, {}).get("comparisons", []))


def judge_family(
    plan: dict[str, Any], orders: dict[str, Records], which: str = "family"
) -> list[Judged]:
    """Every comparison of one declared family, Holm-adjusted across that family's tests."""
    declared = comparisons(plan, which)
    family = [Judged(c["arm"], c["control"], c["expected"], c["source"]) for c in declared]
    tests: list[tuple[Judged, str]] = []
    for judged in family:
        for order, records in orders.items():
            stat = compare(plan, records, judged.arm, judged.control)
            judged.orders[order] = stat
            if stat.get("n"):
                tests.append((judged, order))
    adjusted = holm([j.orders[o]["p"] for j, o in tests])
    for (judged, order), p in zip(tests, adjusted, strict=True):
        judged.orders[order]["p_holm"] = p
    seeds = len(plan["seeds"]["measuring"])
    for judged in family:
        verdicts = {
            o: order_verdict(s, judged.expected, s.get("p_holm"), seeds)
            for o, s in judged.orders.items()
        }
        judged.verdict_a = verdicts.get("a", "not run")
        judged.verdict = _final(verdicts, judged.orders.get("b", {}).get("n") or 0, seeds)
    return family


def _final(verdicts: dict[str, str], b_seeds: int, seeds: int) -> str:
    """Order A's verdict, where it is final alone; a "retains more" or "less" waits for order
    B's seeds (the plan runs every such arm there) and holds only where B agrees."""
    a, b = verdicts.get("a", "not run"), verdicts.get("b", "not run")
    if a not in ("retains more", "retains less"):
        return a
    if b == "not run" or b.startswith("pending"):
        return f"pending (order B: {b_seeds} of {seeds} seeds)"
    if b != a:
        return f"{a} in order A only (order B: {b})"
    return a


def verdict_line(plan: dict[str, Any], judged: Judged) -> str:
    """One table row; a comparison the plan does not declare, or another metric, is refused."""
    both = comparisons(plan) + comparisons(plan, "second_family")
    declared = {(c["arm"], c["control"]) for c in both}
    if (judged.arm, judged.control) not in declared:
        raise ValueError(f"{judged.arm} vs {judged.control}: not in the declared family")
    if judged.metric != plan["metric"]["primary"]:
        raise ValueError(f"{judged.metric}: not the plan's primary metric")
    cells = [f"{judged.arm} vs {judged.control}"]
    for order in ("a", "b"):
        cells.append(_cell(judged.orders.get(order, {"n": 0})))
    cells.append(judged.verdict)
    return "| " + " | ".join(cells) + " |"


def _cell(stat: dict[str, Any]) -> str:
    if not stat.get("n"):
        return "–"
    gain = f"gain {stat['gain_diff']:+.3f} {'matched' if stat['gain_matched'] else 'not matched'}"
    if stat["bootstrap"] is None:  # one pair: no interval and no test yet
        return f"{stat['diff']:+.3f} (raw {stat['raw_change_diff']:+.3f}); {gain}; n {stat['n']}"
    low, high = stat["bootstrap"]
    return (
        f"{stat['diff']:+.3f} [{low:+.3f}, {high:+.3f}] (raw {stat['raw_change_diff']:+.3f}); "
        f"p {stat['p']:.3f}, Holm {stat['p_holm']:.3f}; {gain}; n {stat['n']}"
    )


def render(
    plan: dict[str, Any],
    family: list[Judged],
    second: Sequence[Judged] = (),
    sections: Sequence[str] = (),
) -> str:
    """The verdicts page: the family's table, the second family's, then ``sections`` (lines)."""
    judged = [*family, *second]
    dropped = sorted({p for j in judged for s in j.orders.values() for p in s.get("dropped", [])})
    lines = [
        "# Real-track verdicts",
        "",
        f"Rendered by `python studies/verdicts.py render` from the kept runs, under the plan "
        f"`studies/plans/{plan['campaign']}.yaml` (declared {plan['declared']}). Each cell: "
        "the mean paired difference of general retention (unclipped above-chance ratio, mean "
        "over the kept probes) with its seeds × items bootstrap 95% interval, the raw accuracy "
        "change difference, the paired t p and its Holm adjustment across the family, and the "
        f"gain difference with its TOST at ±{plan['test']['gain_margin']}. A verdict waits "
        f"for the plan's {len(plan['seeds']['measuring'])} measuring seeds; until then its "
        "row is pending and its cells, Holm included, are interim.",
        "",
        f"Probes left out by the drop rule: {', '.join(dropped) or 'none'}.",
        "",
        *family_tables(plan, family, second),
        f"Not in the family: {plan['not_in_family']}",
        "",
        *(f"Erratum, added after the runs: {text}\n" for text in plan.get("errata", [])),
        *sections,
    ]
    return "\n".join(lines)


def family_tables(
    plan: dict[str, Any], family: list[Judged], second: Sequence[Judged]
) -> list[str]:
    """The family's table, then the second family's (the page's head, and claims.md's block)."""
    return [
        "| comparison | order A (persona last) | order B (persona first) | verdict |",
        "|---|---|---|---|",
        *(verdict_line(plan, j) for j in family),
        "",
        *_second_table(plan, second),
    ]


def _second_table(plan: dict[str, Any], second: Sequence[Judged]) -> list[str]:
    if not second:
        return []
    return [
        f"Second family, {plan['second_family']['name']} (Holm across its own tests):",
        "",
        "| comparison | order A (persona last) | order B (persona first) | verdict |",
        "|---|---|---|---|",
        *(verdict_line(plan, j) for j in second),
        "",
    ]
