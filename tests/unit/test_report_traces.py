"""The report plots a method's per-step strength (SAE-FD's λ) along the sequence."""

from __future__ import annotations

from pathlib import Path

from matplotlib.collections import LineCollection, PathCollection

from forgetless.report.plots import (
    budget_limits,
    budget_rollbacks,
    method_traces,
    trace_figure,
    traces,
)


def test_traces_follow_the_tasks_and_skip_runs_without_them(tmp_path: Path) -> None:
    results = {
        "per_task": [
            {"details": {}},
            {"details": {"sae_fd": {"lambda": [10.0, 6.0, 4.0], "share": [0.3, 0.2, 0.15]}}},
            {"details": {"sae_fd": {"lambda": [10.0, 5.0], "sae": {"trained": True}}}},
        ]
    }
    found = method_traces(results)
    assert found["lambda"] == [[10.0, 6.0, 4.0], [10.0, 5.0]]
    assert found["share"] == [[0.3, 0.2, 0.15]]
    picture = traces(results, tmp_path / "traces.png")
    assert picture is not None and picture.stat().st_size > 1000
    assert traces({"per_task": [{"details": {}}]}, tmp_path / "none.png") is None


def test_a_budgets_knob_and_measured_loss_are_plotted(tmp_path: Path) -> None:
    def task(values: list[float], losses: list[float]) -> dict[str, object]:
        trace = [
            {"step": 2 * i, "value": v, "loss": x}
            for i, (v, x) in enumerate(zip(values, losses, strict=True))
        ]
        return {"budget": {"knob": "lam", "metric": "retention", "trace": trace}}

    results = {"per_task": [task([1.0, 2.0], [0.1, 0.06]), task([2.0, 1.5], [0.04, 0.03])]}
    found = method_traces(results)
    assert found["lam (budget)"] == [[1.0, 2.0], [2.0, 1.5]]
    assert found["budget loss (retention)"] == [[0.1, 0.06], [0.04, 0.03]]
    assert traces(results, tmp_path / "budget.png") is not None


def test_a_budgets_bound_is_drawn_beside_its_loss_in_each_task() -> None:
    def task(losses: list[float], bound: float) -> dict[str, object]:
        trace = [{"step": i, "value": 1.0, "loss": x} for i, x in enumerate(losses)]
        return {"budget": {"knob": "lam", "metric": "kl", "max_loss": bound, "trace": trace}}

    results = {"per_task": [task([0.1, 0.06, 0.05], 0.08), task([0.04, 0.03], 0.05)]}
    assert budget_limits(results) == [0.08, 0.05]
    figure = trace_figure(results)
    assert figure is not None
    loss_axes = [ax for ax in figure.axes if ax.get_ylabel().startswith("budget loss")]
    assert len(loss_axes) == 1
    bounds = sorted(
        {
            round(float(y), 6)
            for c in loss_axes[0].collections
            if isinstance(c, LineCollection)
            for y in c.get_paths()[0].vertices[:, 1]
        }
    )
    assert bounds == [0.05, 0.08]
    assert "max_loss" in [t.get_text() for t in loss_axes[0].get_legend().get_texts()]


def test_a_budgets_rollbacks_are_marked_on_its_loss() -> None:
    trace = [
        {"step": 0, "value": 1.0, "loss": 0.04},
        {"step": 2, "value": 2.0, "loss": 0.09, "rolled_back": 1.0},
        {"step": 4, "value": 3.0, "loss": 0.05},
    ]
    budget = {"knob": "lam", "metric": "kl", "max_loss": 0.06, "trace": trace}
    results = {"per_task": [{"budget": budget}, {"budget": {**budget, "trace": trace[:1]}}]}
    assert budget_rollbacks(results) == [[1], []]
    figure = trace_figure(results)
    assert figure is not None
    (loss_axes,) = [ax for ax in figure.axes if ax.get_ylabel().startswith("budget loss")]
    marked = [
        tuple(point)
        for collection in loss_axes.collections
        if isinstance(collection, PathCollection)
        for point in collection.get_offsets().tolist()
    ]
    assert marked == [(1.0, 0.09)]
    assert "rolled back" in [t.get_text() for t in loss_axes.get_legend().get_texts()]
