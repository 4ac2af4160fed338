"""The report plots a method's per-step strength (SAE-FD's λ) along the sequence."""

from __future__ import annotations

from pathlib import Path

from forgetless.report.plots import method_traces, traces


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
