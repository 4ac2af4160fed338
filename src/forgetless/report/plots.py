"""Matplotlib figures for a run and a bench, written as PNG files (Agg backend, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def accuracy_heatmap(results: dict[str, Any], path: Path, label: str = "") -> Path:
    """Rows: base and after each task; columns: sequence tasks then probes."""
    names = results["tasks"] + [f"{p}*" for p in results["probes"]]
    probes = results["probe_accuracy"] or [[] for _ in results["accuracy_matrix"]]
    matrix = np.array([r + p for r, p in zip(results["accuracy_matrix"], probes, strict=True)])
    fig, ax = plt.subplots(figsize=(max(5.5, 1.2 + 0.8 * len(names)), 1.0 + 0.5 * len(matrix)))
    image = ax.imshow(matrix, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_yticks(range(len(matrix)), results["rows"])
    for (i, j), value in np.ndenumerate(matrix):
        ax.text(
            j,
            i,
            f"{value:.2f}",
            ha="center",
            va="center",
            color="white" if value < 0.6 else "black",
        )
    title = "Accuracy after each task (* = retention probe)"
    ax.set_title(f"{label}: {title}" if label else title)
    fig.colorbar(image, ax=ax, fraction=0.04)
    return _save(fig, path)


def task_curves(results: dict[str, Any], path: Path) -> Path:
    """Each task's and probe's accuracy along the sequence."""
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(results["rows"]))
    for j, name in enumerate(results["tasks"]):
        ax.plot(x, [row[j] for row in results["accuracy_matrix"]], marker="o", label=name)
    for j, name in enumerate(results["probes"]):
        ax.plot(
            x,
            [row[j] for row in results["probe_accuracy"]],
            linestyle="--",
            marker=".",
            label=f"{name} (probe)",
        )
    ax.set_xticks(list(x), results["rows"], rotation=20, ha="right")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("accuracy")
    ax.set_title("Accuracy across the sequence")
    ax.legend(fontsize=8, ncol=2)
    return _save(fig, path)


def forgetting_bars(results: dict[str, Any], path: Path) -> Path:
    """Per task: best earlier accuracy minus final accuracy (Chaudhry et al. 2018)."""
    matrix, done = results["accuracy_matrix"], results["completed_tasks"]
    names = results["tasks"][: max(done - 1, 0)]
    peaks = [max(matrix[row][j] for row in range(j + 1, done)) for j in range(len(names))]
    values = [peak - matrix[done][j] for j, peak in enumerate(peaks)]
    fig, ax = plt.subplots(figsize=(max(4, 1 + len(names)), 3.5))
    ax.bar(names, values, color="tab:red")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("forgetting")
    ax.set_title("Forgetting per task (earlier peak − final)")
    return _save(fig, path)


def kl_drift(results: dict[str, Any], path: Path) -> Path:
    drift = results["kl_drift"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(results["rows"]))
    for key, label in [
        ("base_to_model", "KL(base ‖ model)"),
        ("model_to_base", "KL(model ‖ base)"),
    ]:
        ax.plot(x, [np.nan if v is None else v for v in drift[key]], marker="o", label=label)
    ax.set_xticks(list(x), results["rows"], rotation=20, ha="right")
    ax.set_ylabel("nats / token on probes")
    ax.set_title("Output-space drift from the base model")
    ax.legend()
    return _save(fig, path)


TRACE_KEYS = ("lambda", "share")
"""Per-step series a method records under its task details (SAE-FD's λ and distillation share)."""


BUDGET_LOSS = "budget loss"
"""The label that starts a budget's measured-loss series."""


def method_traces(results: dict[str, Any]) -> dict[str, list[list[float]]]:
    """Each recorded series, one list per task (empty for a task without it)."""
    out: dict[str, list[list[float]]] = {}
    for task in results.get("per_task", []):
        budget = task.get("budget")
        if isinstance(budget, dict) and budget.get("trace"):
            checks = budget["trace"]
            out.setdefault(f"{budget['knob']} (budget)", []).append([e["value"] for e in checks])
            out.setdefault(f"{BUDGET_LOSS} ({budget['metric']})", []).append(
                [e["loss"] for e in checks]
            )
        for details in (task.get("details") or {}).values():
            if not isinstance(details, dict):
                continue
            for key in TRACE_KEYS:
                series = details.get(key)
                if isinstance(series, list) and all(isinstance(v, int | float) for v in series):
                    out.setdefault(key, []).append([float(v) for v in series])
    return out


def budget_limits(results: dict[str, Any]) -> list[float | None]:
    """Each traced budget's bound (its ``max_loss``, None where a record lacks it), in the
    order of its loss series."""
    limits: list[float | None] = []
    for task in results.get("per_task", []):
        budget = task.get("budget")
        if isinstance(budget, dict) and budget.get("trace"):
            bound = budget.get("max_loss")
            limits.append(None if bound is None else float(bound))
    return limits


def budget_rollbacks(results: dict[str, Any]) -> list[list[int]]:
    """Each traced budget's checks that rolled the weights back, as indices into its series."""
    return [
        [i for i, entry in enumerate(task["budget"]["trace"]) if entry.get("rolled_back")]
        for task in results.get("per_task", [])
        if isinstance(task.get("budget"), dict) and task["budget"].get("trace")
    ]


def _mark_budget(
    ax: Any, start: int, series: list[float], bound: float | None, rolled: list[int]
) -> None:
    """A budget's bound as a dashed line over its task, and its rollbacks as crosses."""
    if bound is not None:
        ax.hlines(bound, start, start + max(len(series) - 1, 1), color="C3", ls="--", lw=1.0)
    if rolled:
        ax.scatter([start + i for i in rolled], [series[i] for i in rolled], color="C3", marker="x")


def _budget_legend(ax: Any, limits: list[float | None], rollbacks: list[list[int]]) -> None:
    if any(b is not None for b in limits):
        ax.plot([], [], color="C3", ls="--", label="max_loss")
    if any(rollbacks):
        ax.scatter([], [], color="C3", marker="x", label="rolled back")
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=7)


def trace_figure(results: dict[str, Any]) -> Figure | None:
    """The method's per-step series across the sequence, task boundaries marked and a budget's
    bound and rollbacks drawn on its measured loss; None if the method records none."""
    found = method_traces(results)
    if not found:
        return None
    limits, rollbacks = budget_limits(results), budget_rollbacks(results)
    fig, axes = plt.subplots(len(found), 1, figsize=(7, 2.6 * len(found)), squeeze=False)
    for ax, (key, per_task) in zip(axes[:, 0], found.items(), strict=True):
        start = 0
        for index, series in enumerate(per_task):
            ax.plot(range(start, start + len(series)), series, color="C0")
            if key.startswith(BUDGET_LOSS):
                _mark_budget(ax, start, series, limits[index], rollbacks[index])
            ax.axvline(start, color="grey", lw=0.6, ls=":")
            ax.text(start, ax.get_ylim()[1], f" task {index + 1}", va="top", fontsize=7)
            start += len(series)
        ax.set_ylabel(key)
        if key.startswith(BUDGET_LOSS):
            _budget_legend(ax, limits, rollbacks)
    axes[-1, 0].set_xlabel("micro-batch (a method's series) or check (a budget's)")
    fig.suptitle("The method's strength along the sequence")
    return fig


def traces(results: dict[str, Any], path: Path) -> Path | None:
    """:func:`trace_figure` saved at ``path``; None if the method records no series."""
    fig = trace_figure(results)
    return None if fig is None else _save(fig, path)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated in both coordinates (higher is better for both)."""
    return [
        i
        for i, (x, y) in enumerate(points)
        if not any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for x2, y2 in points)
    ]


MARKERS = "osD^v<>P"


def point_style(index: int) -> tuple[int, str]:
    """The ``index``-th variant's tab10 colour and marker: unique for the first 80 variants,
    so a campaign with more than ten never draws two variants alike."""
    return index % 10, MARKERS[(index // 10) % len(MARKERS)]


def tradeoff(rows: list[dict[str, Any]], path: Path) -> Path:
    """New-task gain against probe retention, one point per variant, Pareto front marked.

    Each variant has its own colour and marker (``point_style``) in the legend; points on the
    front are filled, others hollow.
    """
    usable = [r for r in rows if r.get("gain") and r.get("retention")]
    points = [(r["retention"]["mean"], r["gain"]["mean"]) for r in usable]
    front = set(pareto_front(points))
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    colours = plt.get_cmap("tab10")
    for i, (row, (x, y)) in enumerate(zip(usable, points, strict=True)):
        xerr = [[x - row["retention"]["low"]], [row["retention"]["high"] - x]]
        yerr = [[y - row["gain"]["low"]], [row["gain"]["high"] - y]]
        colour_index, marker = point_style(i)
        colour = colours(colour_index)
        ax.errorbar(
            x,
            y,
            xerr=xerr,
            yerr=yerr,
            fmt=marker,
            capsize=3,
            color=colour,
            markersize=8,
            markerfacecolor=colour if i in front else "white",
            label=row["variant"],
        )
    if front:
        ordered = sorted(points[i] for i in front)
        ax.plot(
            [p[0] for p in ordered],
            [p[1] for p in ordered],
            color="black",
            linestyle=":",
            linewidth=1,
            label="Pareto front (filled)",
        )
    ax.set_xlabel("probe retention (higher keeps more)")
    ax.set_ylabel("gain on new tasks (plasticity)")
    ax.set_title("Learning vs keeping (95% intervals)")
    if usable:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        message = (
            "no variant has both a gain and a probe retention\n"
            "(retention needs probes the base model solves)"
        )
        ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)
