"""Rich tables for the end of a run: the accuracy matrix, probes and the forgetting metrics."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

METRIC_LABELS = {
    "average_accuracy": "average accuracy",
    "bwt": "BWT (backward transfer)",
    "fwt": "FWT (forward transfer)",
    "forgetting": "average forgetting",
    "gain": "gain (plasticity)",
    "retention": "probe retention",
    "retention_unclipped": "probe retention, unclipped",
}


def _fmt(value: Any) -> str:
    return (
        "n/a"
        if value is None
        else f"{value:+.3f}"
        if isinstance(value, float) and value < 0
        else f"{value:.3f}"
    )


def accuracy_table(results: dict[str, Any]) -> Table:
    """Rows: base, then after each task; columns: sequence tasks, then probes."""
    table = Table(title="Accuracy matrix (each task by its own scorer)")
    table.add_column("after")
    for name in results["tasks"]:
        table.add_column(name, justify="right")
    for name in results["probes"]:
        table.add_column(f"{name} (probe)", justify="right", style="cyan")
    probe_rows = results["probe_accuracy"] or [[] for _ in results["accuracy_matrix"]]
    for label, row, probes in zip(
        results["rows"], results["accuracy_matrix"], probe_rows, strict=True
    ):
        table.add_row(label, *(f"{v:.2f}" for v in row), *(f"{v:.2f}" for v in probes))
    return table


def metrics_table(results: dict[str, Any]) -> Table:
    table = Table(title="Forgetting metrics")
    table.add_column("metric")
    table.add_column("value", justify="right")
    metrics = results["metrics"]
    for key, label in METRIC_LABELS.items():
        table.add_row(label, _fmt(metrics.get(key)))
    drift = metrics.get("kl_drift") or {}
    table.add_row("KL(base ‖ model) on probes", _fmt(drift.get("base_to_model")))
    table.add_row("KL(model ‖ base) on probes", _fmt(drift.get("model_to_base")))
    return table


SCREEN_COLUMNS = [
    ("average_accuracy", "acc"),
    ("bwt", "BWT"),
    ("gain", "gain"),
    ("retention", "retention"),
]


def _short(value: Any) -> str:
    """``mean±half`` with two decimals: the 95% interval's half width when there are seeds."""
    if value is None:
        return "n/a"
    half = (value["high"] - value["low"]) / 2
    return f"{value['mean']:.2f}" + (f"±{half:.2f}" if value["n"] > 1 else "")


def bench_screen_table(rows: list[dict[str, Any]]) -> Table:
    """The bench at a glance, narrow enough for 80 columns and a pipe; ``report.md`` has all."""
    table = Table(title="Bench (mean ± 95% interval)", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("variant", overflow="fold")
    for _, label in SCREEN_COLUMNS:
        table.add_column(label, justify="right", no_wrap=True)
    table.add_column("time ×seq_ft", justify="right", no_wrap=True)
    for row in rows:
        ratio = row.get("time_vs_seq_ft")
        cells = [_short(row.get(key)) for key, _ in SCREEN_COLUMNS]
        if row.get("joint_training"):
            cells[1] = "n/a"
        table.add_row(row["variant"], *cells, f"{ratio:.2f}" if ratio else "n/a")
    return table
