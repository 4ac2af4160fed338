"""Determinism: the same config and seed give bit-identical results and checkpoints on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from safetensors.torch import load_file

from forgetless.config.loading import validate_config
from forgetless.training.runner import Runner

METHODS = {
    "seq_ft": {"name": "seq_ft"},
    "replay": {"name": "replay", "buffer_size": 16, "ratio": 0.5},
    "ewc": {"name": "ewc", "lam": 1e4, "fisher_samples": 8, "fisher_batch_size": 4},
}
TIMING = {"train_seconds", "steps_per_second", "tokens_per_second", "peak_memory_mb"}


def run(model_dir: Path, out: Path, method: dict[str, Any]) -> dict[str, Any]:
    raw = tiny_run_config(
        model_dir,
        method=method,
        tasks=["reverse", "cipher", "sort"],
        train={"steps": 3, "batch_size": 8, "lr": 1e-2, "max_length": 32},
    )
    cfg = validate_config(raw)
    Runner(cfg, out, Console(quiet=True), progress=False).run()
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    for stats in results["per_task"]:
        for key in TIMING:
            stats.pop(key)
    results.pop("eval_seconds"), results.pop("eval_parts")  # wall times
    results["runtime"].pop("load_at_start")  # the machine's load beside the run
    return results


@pytest.mark.parametrize("name", list(METHODS))
def test_same_seed_gives_bit_identical_results_and_checkpoints(
    name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    first = run(tiny_model_dir, tmp_path / "a", METHODS[name])
    second = run(tiny_model_dir, tmp_path / "b", METHODS[name])
    assert first["status"] == "complete"
    # Exact equality of every number (metrics, matrices, KL drift, per-task losses, events).
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    files = sorted(
        p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file()
    )
    assert files == sorted(
        p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file()
    )
    tensors = [f for f in files if f.suffix == ".safetensors"]
    assert len(tensors) >= 3, "a model checkpoint per task"
    for rel in tensors:
        a, b = load_file(str(tmp_path / "a" / rel)), load_file(str(tmp_path / "b" / rel))
        assert a.keys() == b.keys(), rel
        for key in a:
            assert torch.equal(a[key], b[key]), f"{rel}: {key} differs"
    for rel in (f for f in files if f.name == "method_state.json"):
        assert (tmp_path / "a" / rel).read_text() == (tmp_path / "b" / rel).read_text()
