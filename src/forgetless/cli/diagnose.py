"""Diagnostics of finished runs: update geometry, conflict with the state, and forgetting."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from forgetless.cli.fitted_table import fitted_table

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()
SHORT_COLUMNS = {
    "circuit_size": "size",
    "circuit_fraction": "frac",
    "faithfulness": "faith",
    "retention": "ret",
    "n_specialists": "spec",
    "m_full": "M full",
    "m_empty": "M empty",
    "update_norm": "norm",
    "pairwise_conflict": "pairwise",
    "state_conflict": "state",
    "state_conflict_tn": "state tn",
    "KL(base‖model)": "KL b‖m",
    "KL(model‖base)": "KL m‖b",
    "probe accuracy": "acc",
}
"""Diagnostic table headers short enough for an 80-column terminal."""
CheckpointsArg = Annotated[list[Path], typer.Argument(help="Model folders; the first is the base.")]


def _positive(value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise typer.BadParameter(f"{value} is not above 0")
    return value


def _fraction(value: float) -> float:
    if not 0 < value <= 1:
        raise typer.BadParameter(f"{value} is not in (0, 1]")
    return value


def _open_fraction(value: float) -> float:
    if not 0 < value < 1:
        raise typer.BadParameter(f"{value} is not in (0, 1)")
    return value


def _print_fitted(title: str, columns: Sequence[str], rows: list[list[str]]) -> None:
    table, legend = fitted_table(title, columns, rows, SHORT_COLUMNS, console.width)
    console.print(table)
    if legend:
        console.print(legend)


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
    rank: Annotated[int, typer.Option(min=1, help="Truncated-SVD rank for full fine-tuning.")] = 64,
) -> None:
    """Per task: update norm, conflicts, retention change ΔR; their correlations; a plot."""
    from forgetless.diagnostics.diagnose_geometry import SIGNALS, diagnose_runs

    data = diagnose_runs(run_dirs, out, rank)
    columns = ["task", "update_norm", "pairwise_conflict", "state_conflict", "state_conflict_tn"]
    rows = [
        [Path(row["run"]).name, *[_fmt(row[c]) for c in columns], _fmt(row["retention_change"])]
        for row in data["rows"]
    ]
    _print_fitted("Geometry per task", ["run", *columns, "ΔR"], rows)
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


@app.command()
def attribution(
    run_dir: Annotated[Path, typer.Argument(help="Finished run folder.")],
    independent: Annotated[
        Optional[list[Path]],  # noqa: UP045
        typer.Option(help="One-task runs from the base (repeat the option), for the overlap."),
    ] = None,
    out: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Output JSON (default RUN_DIR/attribution.json)."),
    ] = None,
    samples: Annotated[int, typer.Option(min=1, help="Training samples scored per task.")] = 32,
    top: Annotated[
        float,
        typer.Option(callback=_fraction, help="Top-K fraction of the map normalization."),
    ] = 0.01,
    overlap: Annotated[
        float,
        typer.Option(callback=_open_fraction, help="Top fraction whose sets are compared."),
    ] = 0.05,
    same_model: Annotated[
        bool,
        typer.Option(help="The control: every task's map on the base and on each --independent."),
    ] = True,
) -> None:
    """Per task: the LRP importance map's summary; the overlap of tasks' important sets."""
    from forgetless.diagnostics.diagnose_attribution import diagnose_attribution

    data = diagnose_attribution(run_dir, independent, out, samples, top, overlap, same_model)
    table = Table(title="Importance map per task (on the checkpoint after it)")
    for column in ["task", "correct/scored", "mean R", "share R > 0.5", "s/sample"]:
        table.add_column(column)
    for row in data["per_task"]:
        table.add_row(
            row["task"],
            f"{row['correct']}/{row['samples']}"
            + (" (all used)" if row["fallback_all_samples"] else ""),
            _fmt(row["map"]["mean"]),
            _fmt(row["map"]["frac_above_half"]),
            _fmt(row["seconds_per_sample"], 3),
        )
    console.print(table)
    pairs = Table(
        title=f"Jaccard of the top {overlap:.0%} sets (random: {data['random_jaccard']:.3f})"
    )
    for column in ["training", "tasks", "overall"]:
        pairs.add_column(column)
    for kind in ("sequential", "independent"):
        for pair in data.get(kind, []):
            pairs.add_row(kind, " / ".join(pair["tasks"]), _fmt(pair["jaccard"]["overall"], 3))
    console.print(pairs)
    for key, label in (
        ("same_model_base_mean", "all tasks' maps on the base"),
        ("same_model_independent_mean", "all tasks' maps on each one-task model"),
    ):
        if data.get(key) is not None:
            console.print(f"same-model control, {label}: Jaccard {data[key]:.3f}")
    console.print(f"attribution: {out or run_dir / 'attribution.json'}")


def beside_checkpoints(paths: list[Path], name: str) -> Path:
    """The default output: ``name`` in the folder the checkpoints share, unless that is the
    filesystem's root (models from unrelated places), which is refused in one line."""
    import os

    from forgetless.errors import ConfigError

    shared = Path(os.path.commonpath([str(p.resolve()) for p in paths]))
    if shared == Path(shared.anchor):
        raise ConfigError(
            f"--out: the checkpoints share no folder but {shared}; name where {name} goes"
        )
    return shared / name


@app.command()
def circuits(
    checkpoints: CheckpointsArg,
    behaviour: Annotated[
        str, typer.Option(help="A built-in task's prompts and answers, or a JSONL file.")
    ] = "copy",
    n: Annotated[int, typer.Option(min=1, help="Examples of the behaviour.")] = 16,
    counterfactual: Annotated[
        str, typer.Option(help="mean (mean ablation) or corrupt (corrupted prompts).")
    ] = "mean",
    steps: Annotated[int, typer.Option(min=1, help="DBM optimisation steps.")] = 200,
    lr: Annotated[
        float, typer.Option(callback=_positive, help="DBM learning rate (Adam on mask logits).")
    ] = 0.1,
    temperature: Annotated[
        float, typer.Option(callback=_positive, help="τ of the mask sigmoid σ(ℓ/τ).")
    ] = 1.0,
    final_temperature: Annotated[
        Optional[float],  # noqa: UP045
        typer.Option(
            callback=_positive,
            help="Anneal τ geometrically to this over the steps (binary masks).",
        ),
    ] = None,
    straight_through: Annotated[
        bool, typer.Option(help="Train hard 0/1 masks (straight-through gradient).")
    ] = False,
    sparsity: Annotated[float, typer.Option(min=0, help="λ of the Σ mask penalty.")] = 0.05,
    shift: Annotated[
        float, typer.Option(min=0, help="|Δm_h| threshold for mask-shift classes.")
    ] = 0.1,
    specialist: Annotated[
        float,
        typer.Option(
            min=0, max=1, help="Necessity and sufficiency share for a critical specialist."
        ),
    ] = 0.1,
    delta: Annotated[float, typer.Option(min=0, help="δ of differential vulnerability.")] = 0.1,
    chunk: Annotated[int, typer.Option(min=1, help="Masked copies per effects forward pass.")] = 64,
    effects: Annotated[
        str,
        typer.Option(
            help="Head effects: exact (2N+2 masked forwards) or attribution (first order, "
            "two backward passes; for large models)."
        ),
    ] = "exact",
    seed: Annotated[int, typer.Option(help="Seed for the behaviour data and DBM.")] = 0,
    out: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Output JSON (default: circuits.json beside the checkpoints)."),
    ] = None,
) -> None:
    """Head-level circuits (DBM) of each checkpoint against the base; a table and plots.

    Size, faithfulness, retention, mediation (DCM), specialists, SFT/RL vulnerability."""
    from forgetless.diagnostics.diagnose_circuits import (
        TABLE_COLUMNS,
        DBMSettings,
        Thresholds,
        diagnose_circuits,
    )

    if counterfactual not in ("mean", "corrupt"):
        raise typer.BadParameter("--counterfactual must be mean or corrupt")
    if effects not in ("exact", "attribution"):
        raise typer.BadParameter("--effects must be exact or attribution")
    target = out or beside_checkpoints(checkpoints, "circuits.json")
    data = diagnose_circuits(
        checkpoints,
        behaviour,
        target,
        n=n,
        seed=seed,
        kind=counterfactual,  # type: ignore[arg-type]
        dbm=DBMSettings(
            steps, lr, temperature, sparsity, seed, final_temperature, straight_through
        ),
        thresholds=Thresholds(shift, specialist, delta),
        chunk=chunk,
        effects=effects,  # type: ignore[arg-type]
    )
    rows = [[_fmt(row.get(c), 3) for c in TABLE_COLUMNS] for row in data["rows"]]
    _print_fitted(f"Circuits on {data['behaviour']}", TABLE_COLUMNS, rows)
    for v in data["vulnerability"]:
        o = v["overall"]
        console.print(
            f"epoch {v['epoch']}: SFT-vulnerable {int(o['a_vulnerable'])}, RL-vulnerable "
            f"{int(o['b_vulnerable'])} of {int(o['heads'])} base-circuit heads"
        )
    console.print(f"circuits: {target}  table: {target.with_suffix('.md')}")
    console.print(f"plots: {data['plots']['masks']}  {data['plots']['retention']}")


@app.command()
def drift(
    checkpoints: CheckpointsArg,
    probes: Annotated[
        str, typer.Option(help="Comma-separated built-in retention probes.")
    ] = "copy,upper,facts,add",
    n: Annotated[int, typer.Option(min=1, help="Probe examples per probe.")] = 32,
    seed: Annotated[int, typer.Option(help="Seed of the probe data.")] = 0,
    out: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Output JSON (default: drift.json beside the checkpoints)."),
    ] = None,
) -> None:
    """Output-space KL of each checkpoint against the base on the probes, beside probe accuracy."""
    from forgetless.diagnostics.diagnose_drift import diagnose_drift

    target = out or beside_checkpoints(checkpoints, "drift.json")
    names = [p.strip() for p in probes.split(",") if p.strip()]
    data = diagnose_drift(checkpoints, names, target, n=n, seed=seed)
    rows = [
        [
            row["model"],
            _fmt(row["kl_base_to_model"]),
            _fmt(row["kl_model_to_base"]),
            _fmt(row["accuracy"], 3),
            *[_fmt(row["probes"][p]["accuracy"], 2) for p in names],
        ]
        for row in data["rows"]
    ]
    columns = ["model", "KL(base‖model)", "KL(model‖base)", "probe accuracy", *names]
    _print_fitted("Drift against the base", columns, rows)
    console.print(f"drift: {target}")
