"""``report.md`` and a self-contained ``report.html`` (PNG plots embedded) for a run or a bench."""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgetless.core.rundir import RunDir
from forgetless.core.storage import atomic_write_text
from forgetless.errors import CheckpointError, ConfigError
from forgetless.eval.metrics import RUN_METRICS
from forgetless.report import plots
from forgetless.report.guard import check_report_targets
from forgetless.training.results import Results

METRIC_KEYS = list(RUN_METRICS)
HEADERS = [
    "variant",
    "runs",
    "avg acc",
    "BWT",
    "FWT",
    "forgetting",
    "gain",
    "retention",
    "retention (unclipped)",
    "KL(base‖model)",
    "steps",
    "train s",
    "time ×seq_ft",
    "BWT vs seq_ft",
]


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, dict):
        half = (value["high"] - value["low"]) / 2
        return f"{value['mean']:.3f}" + (f" ± {half:.3f}" if value["n"] > 1 else "")
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def bench_table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    table = []
    for row in rows:
        cells = [row["variant"], str(row["runs"])] + [_cell(row.get(k)) for k in METRIC_KEYS]
        if row.get("joint_training"):
            cells[3] = cells[4] = cells[5] = "n/a (joint)"
        ratio = row.get("time_vs_seq_ft")
        cells += [
            f"{row['steps']['mean']:.0f}" if row["steps"] else "n/a",
            _cell(row["train_seconds"]),
            f"{ratio:.2f}" if ratio else "n/a",
            row.get("bwt_vs_seq_ft", "n/a"),
        ]
        table.append(cells)
    return table


def run_table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["after", *results["tasks"], *[f"{p} (probe)" for p in results["probes"]]]
    probes = results["probe_accuracy"] or [[] for _ in results["accuracy_matrix"]]
    rows = [
        [label, *(f"{v:.2f}" for v in acc), *(f"{v:.2f}" for v in pr)]
        for label, acc, pr in zip(results["rows"], results["accuracy_matrix"], probes, strict=True)
    ]
    return headers, rows


def _markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _html_table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _read(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"nothing to report: {path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        why = getattr(err, "msg", None) or getattr(err, "strerror", None) or type(err).__name__
        raise CheckpointError(f"{path}: unreadable ({why})") from None


def read_results(path: Path) -> dict[str, Any]:
    """A run's ``results.json``, checked as a resume checks it (a one-line error if it is not
    one), with its metrics as today's code computes them."""
    if not path.is_file():
        raise ConfigError(f"nothing to report: {path} not found")
    return Results.read(path).to_json()


def read_bench(path: Path) -> dict[str, Any]:
    """``bench.json``, refused in one line when it is not what ``bench`` writes."""
    bench = _read(path)
    why = _bench_fault(bench)
    if why is not None:
        raise CheckpointError(f"{path}: not a forgetless bench file ({why})")
    data: dict[str, Any] = bench
    return data


def _bench_fault(bench: Any) -> str | None:
    """What keeps ``bench`` from being reported (its rows are aggregated again), or None."""
    from pydantic import ValidationError

    from forgetless.bench.variants import Variant
    from forgetless.core import registry

    if not isinstance(bench, dict):
        return f"the top level is a {type(bench).__name__}"
    for key, kind in (("seeds", int), ("orders", int), ("variants", list), ("runs", list)):
        if not isinstance(bench.get(key), kind):
            return f"{key!r} is missing or not a {kind.__name__}"
    for variant in bench["variants"]:
        try:
            method = Variant.model_validate(variant).method.get("name")
        except ValidationError as err:
            first = err.errors()[0]
            return f"a variant's {'.'.join(map(str, first['loc']))}: {first['msg']}"
        if not isinstance(method, str) or registry.lookup(method) is None:
            return f"a variant's method {method!r} is unknown"
    if not all(_is_run_summary(run) for run in bench["runs"]):
        return "a run lacks its variant, folder, numeric metrics, train_seconds or steps"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_run_summary(run: Any) -> bool:
    return (
        isinstance(run, dict)
        and isinstance(run.get("variant"), str)
        and isinstance(run.get("folder"), str)
        and isinstance(run.get("metrics"), dict)
        and all(v is None or _is_number(v) for k, v in run["metrics"].items() if k in METRIC_KEYS)
        and _is_number(run.get("train_seconds"))
        and _is_number(run.get("steps"))
    )


DETAIL_KEYS = ("kl_drift", "probe_retention", "warnings", "forgetting_since")


def _metric_rows(results: dict[str, Any]) -> list[list[str]]:
    metrics = dict(results["metrics"])
    drift = metrics.get("kl_drift") or {}
    rows = []
    for key, value in metrics.items():
        if key in DETAIL_KEYS:
            continue
        if isinstance(value, dict) and "mean" not in value:  # a group (budget, prose): its parts
            rows += [[f"{key}: {part}", _cell(v)] for part, v in value.items()]
        else:
            rows.append([key, _cell(value)])
    rows += [
        ["KL(base ‖ model)", _cell(drift.get("base_to_model"))],
        ["KL(model ‖ base)", _cell(drift.get("model_to_base"))],
    ]
    return rows


@dataclass(frozen=True)
class Section:
    heading: str
    note: str
    headers: list[str]
    rows: list[list[str]]


def sections_for_run(
    results: dict[str, Any], folder: Path
) -> tuple[str, list[Section], list[Path]]:
    headers, rows = run_table_rows(results)
    pictures = [
        plots.accuracy_heatmap(results, folder / "plots" / "accuracy_matrix.png"),
        plots.task_curves(results, folder / "plots" / "task_curves.png"),
        plots.kl_drift(results, folder / "plots" / "kl_drift.png"),
    ]
    if results["completed_tasks"] > 1:
        pictures.append(plots.forgetting_bars(results, folder / "plots" / "forgetting.png"))
    trace = plots.traces(results, folder / "plots" / "traces.png")
    if trace is not None:
        pictures.append(trace)
    method = results["config"]["method"]["name"]
    sections = [
        Section(
            "Accuracy matrix",
            "Each task by its own scorer (exact match unless the task names another: "
            "docs/evaluation.md); row 0 is the model before any training.",
            headers,
            rows,
        ),
        Section(
            "Metrics",
            "Formulas and signs: docs/metrics.md.",
            ["metric", "value"],
            _metric_rows(results),
        ),
    ]
    probes = results["metrics"].get("probe_retention")
    if probes:
        sections.append(_probe_section(results, probes))
    evals = results.get("eval_seconds")
    if evals and isinstance(evals, list) and all(_is_number(s) for s in evals):
        sections.append(_time_section(results))
    if results.get("events"):
        sections.append(_events_section(results["events"]))
    return f"forgetless run: {method} on {', '.join(results['tasks'])}", sections, pictures


def _probe_section(results: dict[str, Any], probes: dict[str, Any]) -> Section:
    """Per probe: base, now, chance, retention, the absolute drop and the gold log-likelihood."""
    loglik = results.get("probe_loglik") or []
    first, last = (loglik[0], loglik[-1]) if loglik else ([], [])
    rows = []
    for i, (name, p) in enumerate(probes.items()):
        kept = "left out (base ≤ chance)" if p["retention"] is None else f"{p['retention']:.3f}"
        ratio = p.get("ratio")
        unclipped = f"{ratio:.3f}" if isinstance(ratio, int | float) else "n/a"
        ll = (
            f"{first[i]:.3f} → {last[i]:.3f}"
            if i < len(last) and last[i] is not None and first[i] is not None
            else "n/a"
        )
        row = [name, f"{p['base']:.2f}", f"{p['now']:.2f}", f"{p['chance']:.2f}", kept, unclipped]
        rows.append([*row, f"{p['drop']:+.2f}", ll])
    note = (
        "retention = clip((now − chance) / (base − chance), 0, 1); its mean over the probes "
        "above chance is the run's retention. Unclipped, the same ratio goes above 1 when the "
        "model answers more than the base: compare models on it. Log-likelihood: the gold "
        "completion's mean "
        "nats per token, base → now. " + " ".join(results["metrics"].get("warnings", []))
    )
    headers = ["probe", "base", "now", "chance", "retention", "unclipped", "drop", "log-lik"]
    return Section("Probe retention", note.strip(), headers, rows)


def _largest_parts(parts: Any, most: int = 3) -> str:
    """The ``most`` largest parts of one row's ``eval_parts`` ("n/a" where there are none or a
    hand-edited file holds something else)."""
    if not isinstance(parts, dict) or not all(_is_number(v) for v in parts.values()):
        return "n/a"
    largest = sorted(parts.items(), key=lambda item: -item[1])[:most]
    return ", ".join(f"{name} {seconds:.1f}" for name, seconds in largest) or "n/a"


def _time_section(results: dict[str, Any]) -> Section:
    """Per row of the accuracy matrix: the training before it and its evaluation, with the
    evaluation's largest parts (``eval_parts``; absent in a file written before them)."""
    evals, parts = results["eval_seconds"], results.get("eval_parts") or []
    names = ["base", *results["tasks"]]
    trains = [None, *(s.get("train_seconds") for s in results["per_task"] if isinstance(s, dict))]
    rows = []
    for i, seconds in enumerate(evals):
        train = f"{trains[i]:.1f}" if i < len(trains) and _is_number(trains[i]) else "–"
        largest = _largest_parts(parts[i] if i < len(parts) else None)
        rows.append([names[i] if i < len(names) else str(i), train, f"{seconds:.1f}", largest])
    note = "Wall seconds. Row 0 is the base's evaluation (cache: read from eval.cache_base_row)."
    headers = ["after", "training, s", "evaluation, s", "largest evaluation parts, s"]
    return Section("Where the time went", note, headers, rows)


def _events_section(events: list[dict[str, Any]]) -> Section:
    """What happened to the run besides training: resumes that changed its config or data,
    truncated examples, skipped steps, rollbacks."""
    rows = []
    for event in events:
        detail = {k: v for k, v in event.items() if k not in ("type", "after_task", "task")}
        where = event.get("task") or f"after task {event.get('after_task', '?')}"
        rows.append([str(event.get("type", "?")), str(where), json.dumps(detail, default=str)])
    note = "In the order they happened; a resume that changed the config or a data file says so."
    return Section("Events", note, ["event", "when", "detail"], rows)


def sections_for_bench(
    bench: dict[str, Any], folder: Path
) -> tuple[str, list[Section], list[Path]]:
    from forgetless.bench.sweep import aggregate  # rows always follow today's aggregation
    from forgetless.bench.variants import Variant

    bench = {**bench, "rows": aggregate(bench["runs"], [Variant(**v) for v in bench["variants"]])}
    pictures = [plots.tradeoff(bench["rows"], folder / "plots" / "tradeoff.png")]
    for row in bench["rows"]:
        first = next((r for r in bench["runs"] if r["variant"] == row["variant"]), None)
        results_path = RunDir(Path(first["folder"])).results if first else None
        if results_path is not None and results_path.is_file():
            target = folder / "plots" / f"matrix-{_slug(row['variant'])}.png"
            pictures.append(
                plots.accuracy_heatmap(read_results(results_path), target, row["variant"])
            )
    note = (
        f"{bench['seeds']} seed(s) × {bench['orders']} task order(s) per variant; "
        "mean ± half-width of the 95% t-interval. Joint training (mtl) has no BWT/FWT."
    )
    headers, table = HEADERS, bench_table_rows(bench["rows"])
    if any("budget_kept" in row for row in bench["rows"]):
        headers = [*HEADERS, "budget kept (runs)"]
        table = [
            [*cells, row.get("budget_kept", "n/a")]
            for cells, row in zip(table, bench["rows"], strict=True)
        ]
        note += " Budget kept: the runs that ended every task within the forgetting budget."
    return "forgetless bench", [Section("Variants side by side", note, headers, table)], pictures


def write_report(folder: Path) -> tuple[Path, Path]:
    """Write ``report.md`` and ``report.html`` into ``folder`` (a run or a bench output folder)."""
    check_report_targets(folder, bench=(folder / "bench.json").is_file())
    if (folder / "bench.json").is_file():
        title, sections, pictures = sections_for_bench(read_bench(folder / "bench.json"), folder)
    else:
        title, sections, pictures = sections_for_run(read_results(RunDir(folder).results), folder)
    md_parts, html_parts = [f"# {title}"], [f"<h1>{html.escape(title)}</h1>"]
    for sec in sections:
        md_parts.append(
            f"## {sec.heading}\n\n{sec.note}\n\n{_markdown_table(sec.headers, sec.rows)}"
        )
        html_parts.append(
            f"<h2>{html.escape(sec.heading)}</h2><p>{html.escape(sec.note)}</p>"
            + _html_table(sec.headers, sec.rows)
        )
    for picture in pictures:
        md_parts.append(f"![{picture.stem}]({picture.relative_to(folder).as_posix()})")
        data = base64.b64encode(picture.read_bytes()).decode("ascii")
        html_parts.append(
            f'<figure><img alt="{picture.stem}" src="data:image/png;base64,{data}"></figure>'
        )
    md_path, html_path = folder / "report.md", folder / "report.html"
    atomic_write_text(md_path, "\n\n".join(md_parts) + "\n")
    page = _HTML_HEAD.format(title=html.escape(title)) + "\n".join(html_parts) + "</body></html>\n"
    atomic_write_text(html_path, page)
    return md_path, html_path


_HTML_HEAD = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title><style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1100px; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; white-space: nowrap; }}
th {{ background: #f3f3f3; }} img {{ max-width: 100%; }}
</style></head><body>
"""
