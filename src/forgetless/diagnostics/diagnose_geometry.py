"""Geometry signals of a finished run, per task, and their correlation with retention change.

Streams layer by layer: for one weight matrix at a time, the base tensor (full fine-tuning) and
that matrix in every task checkpoint are read, its geometries built, and only scalars kept.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from forgetless.core.rundir import RunDir
from forgetless.core.storage import temp_file_name
from forgetless.core.tensor_files import (
    TIED,
    WEIGHTS_FILE,
    TensorFiles,
    adapter_terms,
)
from forgetless.diagnostics.geometry import (
    Geometry,
    LowRank,
    aggregate,
    combine,
    full_update,
    geometry_from_dense,
    geometry_from_lowrank,
    pairwise_conflict,
    state_conflict,
    subspace_alignment,
)
from forgetless.errors import ForgetlessError

SIGNALS = (
    "update_norm",
    "pairwise_conflict",
    "pairwise_conflict_tn",
    "state_conflict",
    "state_conflict_tn",
    "state_conflict_fw",
    "state_conflict_tn_fw",
    "sar",
)


LOGLIK_TARGET = "retention_change_loglik"
"""The continuous ΔR the run-level and within-run statistics read."""


class GeometryError(ForgetlessError):
    """A run folder cannot be diagnosed (missing results or checkpoints)."""


@dataclass
class TaskAccumulator:
    """Per-layer values of one task, reduced to the task's signals at the end."""

    norm_sq: float = 0.0
    energies: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    state: list[float] = field(default_factory=list)
    state_tn: list[float] = field(default_factory=list)
    pairwise: dict[int, list[float]] = field(default_factory=dict)
    pairwise_tn: dict[int, list[float]] = field(default_factory=dict)
    sar: list[float] = field(default_factory=list)


def load_results(run_dir: Path) -> dict[str, Any]:
    path = RunDir(run_dir).results
    if not path.is_file():
        raise GeometryError(f"{run_dir}: no results.json")
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def retention_changes(matrix: list[list[float]]) -> list[float | None]:
    """ΔR_t = mean_{j<t} (R[t][j] − R[t−1][j]) per task t (1-based rows); None for task 1."""
    out: list[float | None] = []
    for t in range(1, len(matrix)):
        past = range(t - 1)
        diffs = [matrix[t][j] - matrix[t - 1][j] for j in past]
        out.append(sum(diffs) / len(diffs) if diffs else None)
    return out


def loglik_changes(
    loglik: list[list[float | None]], matrix: list[list[float]]
) -> list[float | None]:
    """A continuous ΔR: per task t, the mean change of the gold answers' log-likelihood on the
    past tasks still retained before t (accuracy above 0 then). Accuracy changes say nothing
    once a task sits at 0, and averaging those zeros in makes later positions look harmless."""
    out: list[float | None] = []
    for t in range(1, min(len(loglik), len(matrix))):
        diffs = [
            now - before
            for j in range(t - 1)
            if matrix[t - 1][j] > 0
            and (now := loglik[t][j]) is not None
            and (before := loglik[t - 1][j]) is not None
        ]
        out.append(sum(diffs) / len(diffs) if diffs else None)
    return out


def checkpoints(run_dir: Path, tasks: list[str], done: int) -> list[Path]:
    folders = RunDir(run_dir).task_checkpoints(tasks[:done])
    for folder in folders:
        if not folder.is_dir():
            raise GeometryError(f"{run_dir}: missing checkpoint {folder.name}")
    return folders


def base_weight_files(config: dict[str, Any]) -> list[Path]:
    """The base model's safetensors files (the shipped or cached tiny base without a name)."""
    from forgetless.config.schema import ModelConfig
    from forgetless.models.loading import resolve_source
    from forgetless.training.pretrain import cached_base_dir, shipped_base_dir

    name = config["model"].get("name_or_path")
    if name is None:
        model_cfg = ModelConfig(**config["model"])
        folder = shipped_base_dir(model_cfg) or cached_base_dir(model_cfg)
    else:
        source = resolve_source(name)
        folder = Path(source)
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(source, allow_patterns=["*.safetensors", "*.json"]))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise GeometryError(f"base model {folder}: no safetensors weights")
    return files


def _full_layers(
    base: TensorFiles, ckpts: list[Path], rank: int
) -> Iterator[tuple[list[Geometry], list[Geometry | None], list[float]]]:
    """Per weight matrix: each task's update geometry, the state geometry before it, ‖Δ_t‖_F."""
    states = [TensorFiles([c / WEIGHTS_FILE]) for c in ckpts]
    for key in sorted(states[-1].names()):
        base_key = key if key in base.where else TIED.get(key)
        if base_key is None or base_key not in base.where:
            continue
        theta = [base.get(base_key)] + [s.get(key) for s in states]
        if theta[0].ndim != 2 or not theta[0].is_floating_point():
            continue
        updates, prior, norms = [], [], []
        for t in range(1, len(theta)):
            delta = full_update(theta[t - 1], theta[t])
            norms.append(float(torch.linalg.matrix_norm(delta)))
            updates.append(geometry_from_dense(delta, rank))
            prior.append(
                None if t == 1 else geometry_from_dense(full_update(theta[0], theta[t - 1]), rank)
            )
        yield updates, prior, norms


def _lora_layers(
    ckpts: list[Path], regime: str
) -> Iterator[tuple[list[Geometry], list[Geometry | None], list[float]]]:
    """The same for LoRA: Δ_t and Δ_state as exact low-rank sums of adapters."""
    per_ckpt = [
        {p.name: adapter_terms(p) for p in sorted((c / "adapters").iterdir())} for c in ckpts
    ]
    # own[t]: the adapters task t added; cumulative[t]: those making up θ_t − θ_base.
    own: list[dict[str, LowRank]] = []
    cumulative: list[list[dict[str, LowRank]]] = []
    for t, adapters in enumerate(per_ckpt, start=1):
        if regime == "per_task":
            own.append(adapters[f"task_{t}"])
            cumulative.append([adapters[n] for n in sorted(adapters)])
        elif regime == "merge":
            own.append(adapters["default"])
            cumulative.append([a["default"] for a in per_ckpt[:t]])
        else:  # carry: one adapter holds the whole state
            cumulative.append([adapters["default"]])
            own.append({})
    modules = sorted(set().union(*(a.keys() for c in cumulative for a in c)))
    for module in modules:
        updates, prior, norms = [], [], []
        for t in range(len(ckpts)):
            past = [(1.0, a[module]) for a in (cumulative[t - 1] if t else []) if module in a]
            if regime == "carry":
                now = [(1.0, a[module]) for a in cumulative[t] if module in a]
                delta = combine(now + [(-1.0, lr) for _, lr in past])
            else:
                delta = combine([(1.0, own[t][module])])
            norms.append(
                float(torch.linalg.matrix_norm(delta.dense())) if delta.left.numel() else 0.0
            )
            updates.append(geometry_from_lowrank(delta))
            prior.append(geometry_from_lowrank(combine(past)) if past else None)
        yield updates, prior, norms


def task_signals(run_dir: Path, rank: int = 64) -> list[dict[str, Any]]:
    """One row per completed task of a run: update norm, conflicts, ΔR."""
    results = load_results(run_dir)
    config = results["config"]
    tasks: list[str] = results["tasks"]
    done = int(results.get("completed_tasks", len(results["accuracy_matrix"]) - 1))
    ckpts = checkpoints(run_dir, tasks, done)
    if not ckpts:
        return []
    finetune = config.get("finetune", {}) or {}
    if finetune.get("mode", "full") == "lora":
        layers = _lora_layers(ckpts, finetune.get("lora", {}).get("regime", "carry"))
    else:
        layers = _full_layers(TensorFiles(base_weight_files(config)), ckpts, rank)
    acc = [TaskAccumulator() for _ in ckpts]
    for updates, prior, norms in layers:
        for t, (geom, state, norm) in enumerate(zip(updates, prior, norms, strict=True)):
            a = acc[t]
            a.norm_sq += norm**2
            a.energies.append(geom.energy)
            if state is None:
                continue
            a.weights.append(norm)
            a.state.append(state_conflict(geom, state))
            a.state_tn.append(state_conflict(geom, state, normalize_trace=True))
            a.sar.append(subspace_alignment(geom, state))
            for j in range(t):
                a.pairwise.setdefault(j, []).append(pairwise_conflict(geom, updates[j]))
                a.pairwise_tn.setdefault(j, []).append(pairwise_conflict(geom, updates[j], True))
    delta_r = retention_changes(results["accuracy_matrix"])
    delta_ll = loglik_changes(results.get("loglik") or [], results["accuracy_matrix"])
    rows = []
    for t, a in enumerate(acc):
        pair = [aggregate(v) for v in a.pairwise.values()]
        pair_tn = [aggregate(v) for v in a.pairwise_tn.values()]
        rows.append(
            {
                "run": str(run_dir),
                "task_index": t + 1,
                "task": tasks[t],
                "update_norm": math.sqrt(a.norm_sq),
                "svd_energy_min": min(a.energies) if a.energies else None,
                "pairwise_conflict": aggregate([p for p in pair if p is not None]),
                "pairwise_conflict_tn": aggregate([p for p in pair_tn if p is not None]),
                "state_conflict": aggregate(a.state),
                "state_conflict_tn": aggregate(a.state_tn),
                "state_conflict_fw": aggregate(a.state, a.weights),
                "state_conflict_tn_fw": aggregate(a.state_tn, a.weights),
                "sar": aggregate(a.sar),
                "layers": len(a.energies),
                "retention_change": delta_r[t] if t < len(delta_r) else None,
                "retention_change_loglik": delta_ll[t] if t < len(delta_ll) else None,
            }
        )
    return rows


def _ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pearson(x: list[float], y: list[float]) -> float | None:
    n = len(x)
    if n < 3:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    if sxx <= 0 or syy <= 0:
        return None
    return max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))


def spearman(x: list[float], y: list[float]) -> float | None:
    return pearson(_ranks(x), _ranks(y))


def fisher_interval(r: float | None, n: int, z_crit: float = 1.959964) -> list[float] | None:
    """95% interval by Fisher's z: tanh(atanh r ± 1.96/√(n−3)); needs n ≥ 4."""
    if r is None or n < 4:
        return None
    z = math.atanh(max(-0.999999, min(0.999999, r)))
    half = z_crit / math.sqrt(n - 3)
    return [math.tanh(z - half), math.tanh(z + half)]


def defined_pairs(
    rows: list[dict[str, Any]], signal: str, target: str
) -> tuple[list[float], list[float]]:
    """The (signal, target) values of the rows where both are defined."""
    kept = [r for r in rows if r.get(signal) is not None and r.get(target) is not None]
    return [r[signal] for r in kept], [r[target] for r in kept]


def correlations(
    rows: list[dict[str, Any]], target: str = "retention_change"
) -> dict[str, dict[str, Any]]:
    """Pearson and Spearman of each signal with ΔR (``target``) over rows where both are defined
    (pooled: the points of one run are not independent, see ``run_level``)."""
    out: dict[str, dict[str, Any]] = {}
    for signal in SIGNALS:
        x, y = defined_pairs(rows, signal, target)
        p, s = pearson(x, y), spearman(x, y)
        out[signal] = {
            "n": len(x),
            "pearson": p,
            "pearson_ci95": fisher_interval(p, len(x)),
            "spearman": s,
            "spearman_ci95": fisher_interval(s, len(x)),
        }
    return out


def position_residuals(rows: list[dict[str, Any]], target: str) -> list[dict[str, Any]]:
    """The rows with every signal and ``target`` minus its mean at the same task position over
    all rows given: with the task order permuted between runs, what is left at a position is
    the task's and the state's, not the position's (a later update is smaller and meets more
    forgotten tasks in every order)."""
    by_position: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_position.setdefault(int(row["task_index"]), []).append(row)
    out = [dict(row) for row in rows]
    for key in (*SIGNALS, target):
        means = {
            position: statistics.fmean(values)
            for position, group in by_position.items()
            if (values := [r[key] for r in group if r.get(key) is not None])
        }
        for row in out:
            if row.get(key) is not None:
                row[key] = row[key] - means[int(row["task_index"])]
    return out


def run_level(
    rows: list[dict[str, Any]], target: str, min_points: int = 4
) -> dict[str, dict[str, Any]]:
    """Each signal's Spearman with ``target`` within each run (runs with at least
    ``min_points`` defined points), then the mean and 95% t-interval over runs: the run is the
    unit, where pooling treats a run's tasks as independent draws. ``per_run`` keeps each run's
    value, so that two signals can be compared run by run."""
    from forgetless.bench.stats import mean_interval

    by_run: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_run.setdefault(row["run"], []).append(row)
    out: dict[str, dict[str, Any]] = {}
    for signal in SIGNALS:
        per_run: dict[str, float] = {}
        for run, run_rows in by_run.items():
            x, y = defined_pairs(run_rows, signal, target)
            rho = spearman(x, y) if len(x) >= min_points else None
            if rho is not None:
                per_run[run] = rho
        found = mean_interval(list(per_run.values()))
        out[signal] = {
            "runs": len(per_run),
            "spearman": found.as_dict() if found else None,
            "per_run": per_run,
        }
    return out


def plot_conflict(rows: list[dict[str, Any]], path: Path) -> Path:
    """Scatter of each conflict signal against ΔR, one panel per signal (PNG, atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ("state_conflict", "state_conflict_tn", "pairwise_conflict")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, signal in zip(axes, panels, strict=True):
        pts = [
            (r[signal], r["retention_change"])
            for r in rows
            if r[signal] is not None and r["retention_change"] is not None
        ]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=22)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlabel(signal)
        ax.set_ylabel("ΔR (negative = forgetting)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{temp_file_name(path)}.png")  # savefig picks the format from the suffix
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


CONTRASTS = ("update_norm", "pairwise_conflict", "sar")
"""The signals state conflict is compared with (does it predict better than each?)."""


def within_run_summary(rows: list[dict[str, Any]], target: str) -> dict[str, Any]:
    """Each signal's correlation with ``target`` inside runs (run and position fixed effects,
    jackknife interval over runs), and state conflict's |r| against each of ``CONTRASTS``'."""
    from forgetless.diagnostics.within_run import contrast, within_run

    return {
        "target": target,
        "signals": within_run(rows, SIGNALS, target),
        "state_conflict_minus": {
            other: contrast(rows, "state_conflict", other, target) for other in CONTRASTS
        },
    }


def diagnose_runs(run_dirs: list[Path], out: Path | None = None, rank: int = 64) -> dict[str, Any]:
    """Rows of every run and pooled correlations, written to ``out`` (default: first run)."""
    from forgetless.core.ownership import check_output_file, write_output_file

    target = out or run_dirs[0] / "geometry.json"
    check_output_file(target, "geometry", "geometry.json", [target.with_suffix(".png")])
    rows: list[dict[str, Any]] = []
    for run_dir in run_dirs:
        rows.extend(task_signals(run_dir, rank))
    data = {
        "schema_version": 1,
        "runs": [str(r) for r in run_dirs],
        "svd_rank": rank,
        "rows": rows,
        "correlations": correlations(rows),
        "correlations_loglik": correlations(rows, LOGLIK_TARGET),
        "run_level": run_level(rows, LOGLIK_TARGET),
        "run_level_position_controlled": run_level(
            position_residuals(rows, LOGLIK_TARGET), LOGLIK_TARGET
        ),
        "within_run": within_run_summary(rows, LOGLIK_TARGET),
        "plot": str(target.with_suffix(".png")),
    }
    plot_conflict(rows, target.with_suffix(".png"))
    write_output_file(target, "geometry", data)
    return data
