"""``forgetless diagnose attribution`` on tiny runs: maps per task, sequential and independent
overlaps, written atomically next to the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from typer.testing import CliRunner

from forgetless.cli.app import app
from forgetless.config.loading import validate_config
from forgetless.diagnostics.diagnose_attribution import (
    AttributionRunError,
    diagnose_attribution,
    grouped_overlap,
    layer_of,
)
from forgetless.training.runner import Runner


def _run(model_dir: Path, out: Path, tasks: list[str]) -> Path:
    raw: dict[str, Any] = tiny_run_config(model_dir, tasks=tasks)
    Runner(validate_config(raw), out, Console(quiet=True), progress=False).run()
    return out


def test_layer_grouping_and_grouped_overlap() -> None:
    assert layer_of("model.layers.3.mlp.up_proj.weight") == "layer 3"
    assert layer_of("model.embed_tokens.weight") == "other"
    a = {"model.layers.0.x": torch.arange(10.0), "model.layers.1.x": torch.arange(10.0)}
    b = {"model.layers.0.x": torch.arange(10.0), "model.layers.1.x": -torch.arange(10.0)}
    out = grouped_overlap(a, b, 0.2)
    assert out["layer 0"] == 1.0 and out["layer 1"] == 0.0
    assert 0.0 < out["overall"] < 1.0


def test_diagnose_attribution_writes_maps_and_overlaps(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    seq = _run(tiny_model_dir, tmp_path / "seq", ["reverse", "cipher"])
    solo = [_run(tiny_model_dir, tmp_path / t, [t]) for t in ("reverse", "cipher")]
    data = diagnose_attribution(seq, solo, samples=3, overlap_fraction=0.1)
    assert [r["task"] for r in data["per_task"]] == ["reverse", "cipher"]
    for row in data["per_task"]:
        assert row["samples"] == 3
        assert 0 < row["map"]["mean"] <= 1
        assert {"layer 0", "layer 1"} <= set(row["per_layer"])
    for kind in ("sequential", "independent"):
        (pair,) = data[kind]
        assert sorted(pair["tasks"]) == ["cipher", "reverse"]
        assert 0 <= pair["jaccard"]["overall"] <= 1
    assert data["random_jaccard"] == pytest.approx(0.1 / 1.9)
    stored = json.loads((seq / "attribution.json").read_text())
    assert stored["sequential_mean"] == data["sequential_mean"]
    (base_pair,) = data["same_model_base"]  # the control: both maps on one untrained model
    assert sorted(base_pair["tasks"]) == ["cipher", "reverse"]
    assert len(data["same_model_independent"]) == 2  # one pair on each one-task model
    for key in ("same_model_base_mean", "same_model_independent_mean"):
        assert 0 <= data[key] <= 1


def test_cli_names_a_missing_run(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["diagnose", "attribution", str(tmp_path / "nope")])
    assert result.exit_code != 0
    with pytest.raises(AttributionRunError, match=r"missing config\.yaml"):
        diagnose_attribution(tmp_path)
