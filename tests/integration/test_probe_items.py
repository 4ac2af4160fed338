"""Each probe question's outcome is kept per row, so intervals can resample items and seeds."""

from __future__ import annotations

from pathlib import Path

from conftest import tiny_run_config
from rich.console import Console

from forgetless.config.loading import validate_config
from forgetless.training.results import Results
from forgetless.training.runner import Runner


def test_probe_items_match_probe_accuracy_in_every_row(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = validate_config(
        tiny_run_config(tiny_model_dir, probes=["copy", "upper"], eval={"n_eval": 8, "n_train": 32,
                        "batch_size": 8, "kl_examples": 4, "between": 4})
    )  # fmt: skip
    results = Runner(cfg, tmp_path, Console(quiet=True), progress=False).run().to_json()
    items, accuracy = results["probe_items"], results["probe_accuracy"]
    assert len(items) == len(accuracy) == 3
    for row_items, row_accuracy in zip(items, accuracy, strict=True):
        for outcomes, score in zip(row_items, row_accuracy, strict=True):
            assert set(outcomes) <= {"0", "1"} and outcomes
            assert outcomes.count("1") / len(outcomes) == score
    assert [len(o) for o in items[1]] == [4, 4] and [len(o) for o in items[-1]] == [8, 8]
    assert Results.read(tmp_path / "results.json").probe_items == items
