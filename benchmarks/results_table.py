"""``benchmarks/RESULTS.md`` from the reports ``run_all.py`` collected: the targets first, then
one table per benchmark. Pure formatting: every figure is read from a report of this run."""

from __future__ import annotations

import statistics
from typing import Any

Report = dict[str, Any]


def _x(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}×"


def _report(summary: Report, name: str) -> Report | None:
    section = summary["sections"].get(name) or {}
    report: Report | None = section.get("report")
    return report


def _find(rows: list[Report], **match: Any) -> Report | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def growth_cause(row: Report, tolerance: float) -> str | None:
    """The measured cause of a growing step, recomputed from the row's points (never a name)."""
    from task_growth import _linear_why, _width_why

    return _width_why(row["points"][-1], tolerance) or _linear_why(row["points"], tolerance)


def paired_ratios(num: list[float], den: list[float]) -> list[float]:
    """Repeat ``i`` of the method over repeat ``i`` of its baseline (timed side by side)."""
    return [a / b for a, b in zip(num, den, strict=False) if b]


def spread(ratios: list[float]) -> float | None:
    """Repeat-to-repeat spread of a ratio: half the range of its per-repeat values."""
    return (max(ratios) - min(ratios)) / 2 if len(ratios) > 1 else None


def verdict(value: float, half: float | None, target: float, below: bool) -> bool | None:
    """Met only when the margin to the target exceeds the spread; ``None``: no spread measured,
    so no verdict."""
    if half is None:
        return None
    margin = target - value if below else value - target
    return margin > half


def _runs(report: Report, case: str, key: str) -> list[float]:
    return [float(r[key]) for r in report.get("runs", {}).get(case, []) if key in r]


def targets(summary: Report) -> list[dict[str, Any]]:
    """Each target: what, measured, its spread, target, met (None: not measured or no spread)."""
    out: list[dict[str, Any]] = []

    def add(what: str, ratios: list[float], target: float, below: bool, digits: int = 3) -> None:
        value = statistics.median(ratios) if ratios else None
        half = spread(ratios)
        sign = "≤" if below else "≥"
        shown = "–" if value is None else f"{value:.{digits}f}×"
        out.append(
            {
                "what": what,
                "value": value,
                "spread": half,
                "shown": shown + ("" if half is None else f" ± {half:.{digits}f}"),
                "target": f"{sign} {target:g}",
                "met": None if value is None else verdict(value, half, target, below),
            }
        )

    anchored = _report(summary, "anchored_overhead")
    if anchored:
        times = paired_ratios(
            _runs(anchored, "anchored", "median_step_s"), _runs(anchored, "seq_ft", "median_step_s")
        )
        add("`anchored` inner step / `seq_ft` step", times, 1.2, True)
        idle = _runs(anchored, "idle", "peak_mb")
        above = [
            (a - i) / max(s - i, 1e-9)
            for a, s, i in zip(
                _runs(anchored, "anchored", "peak_mb"),
                _runs(anchored, "seq_ft", "peak_mb"),
                idle,
                strict=False,
            )
        ]
        add(
            "`anchored` training peak memory / `seq_ft`'s (above the idle process)",
            above,
            1.3,
            True,
        )
    sae = _report(summary, "sae_fd_overhead")
    if sae:
        quarter = paired_ratios(
            _runs(sae, "sae_fd@0.25/fold", "median_step_s"), _runs(sae, "seqlora", "median_step_s")
        )
        add("`sae_fd` step / SeqLoRA step, anchor batch ¼", quarter, 1.4, True)
    attribution = _report(summary, "attribution_overhead")
    if attribution:
        gate = paired_ratios(
            _runs(attribution, "update_gate", "median_step_s"),
            _runs(attribution, "seq_ft", "median_step_s"),
        )
        add("`attribution_gate` step / `seq_ft` step", gate, 1.1, True)
    throughput = _report(summary, "throughput")
    if throughput:
        ratios = paired_ratios(
            throughput["forgetless_steps_per_s"], throughput["hf_trainer_steps_per_s"]
        )
        add("step loop throughput / plain HF `Trainer`", ratios, 0.95, False)
    anchors = _report(summary, "sae_fd_anchor_precision")
    if anchors:
        diff = anchors["bwt_difference"]
        half = (diff["high"] - diff["low"]) / 2
        out.append(
            {
                "what": "`sae_fd` float16 anchors: paired BWT difference to float32 (95% interval)",
                "value": diff["mean"],
                "spread": half,
                "shown": f"{diff['mean']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]",
                "target": "within ± 0.02",
                "met": diff["low"] >= -0.02 and diff["high"] <= 0.02,
            }
        )
    for name, key, limit, what in (
        ("demo_bench_time", "cold_seconds", 300, "bench demo (`make demo`), empty cache, s"),
        ("demo_time", "cold_seconds", 120, "single-run demo, empty cache, s"),
    ):
        report = _report(summary, name)
        if report:
            times = [float(t) for t in report.get(f"{key}_repeats", [report[key]])]
            value, half = statistics.median(times), spread(times)
            out.append(
                {
                    "what": what,
                    "value": value,
                    "spread": half,
                    "shown": f"{value:.0f} s" + ("" if half is None else f" ± {half:.0f}"),
                    "target": f"≤ {limit}",
                    "met": None if half is None else limit - value > half,
                }
            )
    growth = _report(summary, "task_growth")
    if growth:
        tolerance = growth["settings"]["tolerance"]
        unexplained = [
            r["method"] for r in growth["rows"] if r["grows"] and not growth_cause(r, tolerance)
        ]
        out.append(
            {
                "what": "methods whose step cost grows (2 → 8 tasks) without a measured cause",
                "value": len(unexplained),
                "spread": None,
                "shown": ", ".join(unexplained) or "none",
                "target": "none",
                "met": not unexplained,
            }
        )
    return out


def _targets_md(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| what | measured | target | met |", "|---|---|---|---|"]
    for r in rows:
        met = "– (no spread)" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(f"| {r['what']} | {r['shown']} | {r['target']} | {met} |")
    return lines


def _methods_md(report: Report) -> list[str]:
    """Each method over ``seq_ft``: the ratio of medians, ± half the range of the per-repeat
    ratios (repeat i of the method over repeat i of ``seq_ft``)."""
    rows = report["rows"]
    names = list(dict.fromkeys(r["method"] for r in rows))
    lines = [
        "| method | full: step | full: task | full: peak | LoRA: step | LoRA: task | LoRA: peak |"
        " state after 1 task |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        cells = []
        state = 0
        for mode in ("full", "lora"):
            row = _find(rows, method=name, mode=mode)
            if row is None:
                cells += ["n/a"] * 3
                continue
            state = max(state, row["state_bytes"])
            runs = report.get("runs", {})
            mine, base = runs.get(f"{name}/{mode}", []), runs.get(f"seq_ft/{mode}", [])
            for key, shown in (
                ("step_s", row["step_ratio"]),
                ("task_s_per_step", row["task_ratio"]),
                ("peak_mb", row["peak_ratio"]),
            ):
                ratios = paired_ratios([r[0][key] for r in mine], [r[0][key] for r in base])
                half = spread(ratios)
                cells.append(_x(shown) + ("" if half is None else f" ± {half:.2f}"))
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {_bytes(state)} |")
    return lines


def _bytes(n: int) -> str:
    if n == 0:
        return "0"
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _growth_md(report: Report) -> list[str]:
    rows = report["rows"]
    if not rows:
        return []
    tasks = [p["tasks"] for p in rows[0]["points"]]
    last = tasks[-1]
    head = " | ".join(f"step at {t} tasks" for t in tasks[1:])
    lines = [
        f"| method | {head} | whole stage at {last} tasks | raw step at {last} tasks | "
        f"control's change | padded width at {last} tasks | state at {last} tasks | grows | why |",
        "|---|" + "---|" * (len(tasks) + 6),
    ]
    tolerance = report["settings"]["tolerance"]
    for r in rows:
        pts = r["points"]
        cells = " | ".join(_x(p["step_growth"]) for p in pts[1:])
        why = (growth_cause(r, tolerance) or "**no measured cause**") if r["grows"] else ""
        grows = "step" if r["grows"] else ("stage" if r["task_grows"] else "no")
        end = pts[-1]
        lines.append(
            f"| `{r['method']}` ({r['mode']}) | {cells} | {_x(end['task_growth'])} | "
            f"{_x(end.get('raw_step_growth', end['step_growth']))} | "
            f"{_x(end['control_drift']) if 'control_drift' in end else '–'} | "
            f"{_x(end['width_growth']) if 'width_growth' in end else '–'} | "
            f"{_bytes(end['state_bytes'])} | {grows} | {why} |"
        )
    return lines


def _storage_md(summary: Report) -> list[str]:
    lines = ["| what | measured |", "|---|---|"]
    anchored = _report(summary, "anchored_overhead")
    if anchored:
        c = anchored["cache"]
        lines.append(
            f"| `anchored` cache per completion token (top-k {c['top_k']} of {c['vocab_size']})"
            f" | {c['bytes_per_token']} B ({c['bytes'] / 1e6:.2f} MB for {c['tokens']} tokens) |"
        )
        lines.append(
            f"| `anchored` whole task (reference SFT + caches + inner steps) / `seq_ft` task | "
            f"{_x(anchored['task_cost']['time_ratio'])} |"
        )
    sae = _report(summary, "sae_fd_overhead")
    if sae:
        s = sae["storage"]
        lines.append(
            f"| `sae_fd` anchors per token ({s['dtype']}, d = {s['d']}) / per task "
            f"({s['samples']} samples) | {s['bytes_per_token']} B (float32: "
            f"{s['float32_bytes_per_token']} B) / {s['bytes'] / 1e6:.2f} MB |"
        )
        curve = ", ".join(
            f"{c['anchor_batch_fraction']:g} {c['anchor_forward']}: {_x(c['step_time_ratio'])} "
            f"time, {_x(c['peak_memory_ratio'])} memory"
            for c in sae["sae_fd"]
        )
        lines.append(f"| `sae_fd` step / SeqLoRA by anchor batch fraction | {curve} |")
    attribution = _report(summary, "attribution_overhead")
    if attribution:
        rel = attribution["relevance"]
        grad = attribution["cases"]["gradient_gate"]["step_time_ratio"]
        lines.append(
            f"| `attribution_gate` relevance pass per sample / map bytes per parameter | "
            f"{rel['seconds_per_sample'] * 1e3:.1f} ms / "
            f"{rel['map_bytes_float16'] / rel['parameters']:.0f} B (float16) |"
        )
        lines.append(f"| `attribution_gate` gradient-gate step / `seq_ft` step | {_x(grad, 3)} |")
    return lines


def _geometry_md(report: Report) -> list[str]:
    rows = [r for r in report["rows"] if "error" not in r]
    lines = [
        "| op | width | rank | tasks | low-rank s | low-rank peak MiB | dense s | dense peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["op"], r["width"], r["rank"], r["tasks"]) for r in rows))
    for op, width, rank, tasks in keys:
        low = _find(rows, op=op, width=width, rank=rank, tasks=tasks, path="lowrank")
        dense = _find(rows, op=op, width=width, rank=rank, tasks=tasks, path="dense")

        def cells(r: Report | None) -> str:
            return "– | –" if r is None else f"{r['seconds']:.3f} | {r['peak_mb']:.0f}"

        lines.append(f"| {op} | {width} | {rank} | {tasks} | {cells(low)} | {cells(dense)} |")
    failed = [r for r in report["rows"] if "error" in r]
    lines += [f"\n{r['op']} {r['path']} d {r['width']} r {r['rank']}: {r['error']}" for r in failed]
    return lines


def _circuits_md(report: Report) -> list[str]:
    lines = [
        "| prompts | effects: passes batched / loop | loop ÷ batched | loop ÷ chunks of 8 |"
        " DBM step: loop passes | loop ÷ DBM |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        e, d = r["effects"], r["dbm_step"]
        lines.append(
            f"| {r['prompts']} | {e['batched_forward_passes']} / {e['loop_forward_passes']} | "
            f"{_x(e['loop_over_batched'])} | {_x(e['loop_over_chunk8'])} | "
            f"{d['loop_forward_passes']} | {_x(d['loop_over_batched'])} |"
        )
    return lines


def _took(summary: Report) -> str:
    if not summary.get("render_only"):
        return f"in {summary['wall_seconds']:.0f} s"
    times = sorted(s["written"] for s in summary["sections"].values() if "written" in s)
    span = f"reports written {times[0]} to {times[-1]}, " if times else ""
    return f"({span}table rebuilt with --render-only)"


def render(summary: Report) -> tuple[str, dict[str, Any]]:
    """The Markdown page and the figures it shows (for ``RESULTS.json``)."""
    m = summary["machine"]
    rows = targets(summary)
    out = [
        "# Benchmark results",
        "",
        f"Measured {summary['date']} with `{summary['command']}` {_took(summary)}"
        f" on {m['cpu']} ({m['cores']} cores, {m['device']}, {m['torch_threads']} torch thread(s)),"
        f" Python {m['python']}, torch {m['torch']}. Ratios are of medians measured side by side"
        " in one run; reports: `benchmarks/results/*.json`.",
        "",
        "## Targets",
        "",
        *_targets_md(rows),
    ]
    sections = [
        (
            "method_steps",
            "## Every method against `seq_ft` (second task, after one past task)",
            "step: median training step; task: the whole task's training (a method's own stage "
            "included) per plan step; peak: the process's peak memory over the task.",
            _methods_md,
        ),
        (
            "task_growth",
            "## Step cost against the number of past tasks",
            "At the 4th and 8th task: the method's median step over a stateless `seq_ft` "
            "control's timed around it in the same process, divided by that ratio at the 2nd "
            "task (median over repeats); the control steps on the timed task's data. Raw: the "
            "step alone over its own at the 2nd task; the control's change: a plain step's "
            "(the tasks' lengths differ, and a process's steps slow as it ages). Padded "
            "width: tokens per training forward, the same ratio (past tasks' samples in the "
            "batch widen it).",
            _growth_md,
        ),
        (
            "geometry_scaling",
            "## Geometry conflict (BW²) and GCWM merge: low-rank vs dense",
            "",
            _geometry_md,
        ),
        (
            "circuits_speed",
            "## Head effects and DBM: batched vs one head at a time",
            "",
            _circuits_md,
        ),
    ]
    out += ["", "## Sizes and passes", "", *_storage_md(summary)]
    for name, title, note, fn in sections:
        report = _report(summary, name)
        if report:
            out += ["", title, "", *([note, ""] if note else []), *fn(report)]
    skipped = [n for n, s in summary["sections"].items() if "skipped" in s or "error" in s]
    if skipped:
        out += [
            "",
            "Not run or failed: "
            + ", ".join(
                f"{n} ({summary['sections'][n].get('skipped') or summary['sections'][n]['error']})"
                for n in skipped
            ),
        ]
    figures = {"targets": rows}
    return "\n".join(out) + "\n", figures
