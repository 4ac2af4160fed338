"""Diagnostics of finished runs: update geometry, conflict with the state, and forgetting."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()


def _fmt(value: object, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


@app.command()
def geometry(
    run_dirs: Annotated[list[Path], typer.Argument(help="Finished run folder(s) to pool.")],
    out: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Output JSON (default RUN_DIR/geometry.json of the first run)."),
    ] = None,
    rank: Annotated[int, typer.Option(help="Truncated-SVD rank for full fine-tuning.")] = 64,
) -> None:
    """Per task: update norm, conflicts, retention change ΔR; their correlations; a plot."""
    from forgetless.diagnostics.geometry_run import SIGNALS, diagnose_runs

    data = diagnose_runs(run_dirs, out, rank)
    table = Table(title="Geometry per task")
    columns = ["task", "update_norm", "pairwise_conflict", "state_conflict", "state_conflict_tn"]
    for column in ["run", *columns, "ΔR"]:
        table.add_column(column)
    for row in data["rows"]:
        cells = [_fmt(row[c]) for c in columns]
        table.add_row(Path(row["run"]).name, *cells, _fmt(row["retention_change"]))
    console.print(table)
    corr = Table(title="Correlation with ΔR (95% Fisher-z interval)")
    for column in ["signal", "n", "pearson", "interval", "spearman", "interval "]:
        corr.add_column(column)
    for signal in SIGNALS:
        c = data["correlations"][signal]
        corr.add_row(
            signal,
            str(c["n"]),
            _fmt(c["pearson"], 3),
            _fmt(
                c["pearson_ci95"] and "[" + ", ".join(f"{v:.2f}" for v in c["pearson_ci95"]) + "]"
            ),
            _fmt(c["spearman"], 3),
            _fmt(
                c["spearman_ci95"] and "[" + ", ".join(f"{v:.2f}" for v in c["spearman_ci95"]) + "]"
            ),
        )
    console.print(corr)
    target = out or run_dirs[0] / "geometry.json"
    console.print(f"geometry: {target}  plot: {data['plot']}")
