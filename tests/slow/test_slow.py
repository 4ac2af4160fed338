"""Slow tier (`make test-slow`): the SIGKILL matrix, and the demo forgets.

Each case kills a run with SIGKILL at one point (tests/crash_harness.py names them), re-runs it
into the same folder, and checks that the re-run finishes with no file left half-written, the
method's state restored, and the accuracy matrix, per-step losses and final weights and method
state of an uninterrupted run with the same seed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_runs import assert_whole, cli, final_state, killed_at, results, write_config
from conftest import tiny_run_config

from forgetless.testing import smoke_method

pytestmark = pytest.mark.slow
STEPS = 6  # per task; step checkpoints every 2 steps, so 3 saves per task

# (method, fine-tuning mode, kill point, at the n-th time the run reaches it)
FAULTS = [
    ("seq_ft", "full", "step", STEPS + 4),  # task 2, mid step 4: resume from step 2
    ("seq_ft", "full", "step_checkpoint", 5),  # task 2's step-4 save, half written
    ("seq_ft", "full", "checkpoint", 2),  # task 2's weights, half written
    ("seq_ft", "full", "results", 2),  # task 1's results.json, half written
    ("seq_ft", "full", "between_tasks", 1),  # after task 1, before task 2
    ("ewc", "full", "step", STEPS + 3),  # the Fisher and anchor of task 1 restored mid-task
    ("ewc", "full", "task_end", 2),  # during task 2's Fisher
    ("replay", "full", "task_end", 1),  # during task 1's buffer update
    ("sae_fd", "lora", "step", STEPS + 4),  # λ's EMA and the anchors restored mid-task
    ("sae_fd", "lora", "task_end", 1),  # during task 1's anchor capture
    ("attribution_gate", "full", "task_end", 1),  # during task 1's importance map
    ("anchored", "full", "step", 3),  # inside the reference's SFT: resume from its step 2
    ("anchored", "full", "step", 9),  # inner loop of outer iteration 2: earlier calls replayed
    ("task_arithmetic", "full", "merge", 2),  # after task 2's merge, before it is saved
]
TIMING = {"train_seconds", "steps_per_second", "tokens_per_second", "peak_memory_mb"}


def _raw(model_dir: Path, method: str, mode: str) -> dict[str, Any]:
    case = smoke_method(method)[0]
    train = {"steps": STEPS, "batch_size": 8, "lr": 1e-3, "max_length": 32, "checkpoint_every": 2}
    return tiny_run_config(
        model_dir, method=case, finetune={"mode": mode, "lora": {"r": 2}}, train=train
    )


def _untimed(value: Any) -> Any:
    """A record without timings (and without whether SAE-FD's SAE was trained or reused)."""
    if isinstance(value, dict):
        return {
            k: _untimed(v)
            for k, v in value.items()
            if k not in TIMING and "seconds" not in k and k != "sae"
        }
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _per_task(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [_untimed(task) for task in data["per_task"]]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    done: dict[tuple[str, str], Path] = {}

    def get(method: str, mode: str) -> Path:
        if (method, mode) not in done:
            folder = tmp_path_factory.mktemp(f"full-{method}")
            cli(write_config(folder, _raw(tiny_model_dir, method, mode)), folder / "out")
            done[method, mode] = folder / "out"
        return done[method, mode]

    return get


@pytest.mark.parametrize(("method", "mode", "point", "n"), FAULTS)
def test_sigkill_then_rerun_matches_an_uninterrupted_run(
    tiny_model_dir: Path,
    tmp_path: Path,
    uninterrupted: Any,
    method: str,
    mode: str,
    point: str,
    n: int,
) -> None:
    config = write_config(tmp_path, _raw(tiny_model_dir, method, mode))
    out = tmp_path / "out"
    killed_at(point, n, config, out)
    assert results(out)["status"] == "running"
    cli(config, out)

    full_dir = uninterrupted(method, mode)
    full, resumed = results(full_dir), results(out)
    assert resumed["status"] == "complete"
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["probe_accuracy"] == full["probe_accuracy"]
    assert _per_task(resumed) == _per_task(full)
    expected, got = final_state(full_dir), final_state(out)
    assert got.keys() == expected.keys()
    for name, tensors in expected.items():
        assert got[name].keys() == tensors.keys(), name
        for key, value in tensors.items():
            assert torch.equal(got[name][key], value), f"{name}: {key}"
    assert_whole(out)


def test_demo_shows_graded_forgetting(tmp_path: Path) -> None:
    """The built-in demo (shipped base): seq_ft learns each task and forgets the sequence and part
    of the probes, neither nothing nor everything (docs/tiny-suite.md)."""
    subprocess.run(
        [sys.executable, "-m", "forgetless.cli.app", "run", "--out", str(tmp_path), "--quiet"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    metrics, probes = results["metrics"], results["probe_accuracy"]
    assert metrics["bwt"] < 0 and metrics["gain"] >= 0.8
    assert min(probes[0]) >= 0.9
    lost = 1 - sum(probes[-1]) / sum(probes[0])
    assert 0.2 <= lost <= 0.8
