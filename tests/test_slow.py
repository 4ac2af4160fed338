"""Slow tier (`make test-slow`): a real SIGKILL during the second task; the demo forgets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import tiny_run_config

pytestmark = pytest.mark.slow


def _command(config: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "forgetless.cli.app",
        "run",
        str(config),
        "--out",
        str(out),
        "--quiet",
    ]


def _completed(out: Path) -> int:
    try:
        return int(json.loads((out / "results.json").read_text())["completed_tasks"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def test_sigkill_during_second_task_then_rerun_matches(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    raw = tiny_run_config(
        tiny_model_dir, train={"steps": 400, "batch_size": 8, "lr": 1e-3, "max_length": 32}
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    subprocess.run(_command(config, tmp_path / "full"), check=True, stdout=subprocess.DEVNULL)

    out = tmp_path / "killed"
    process = subprocess.Popen(_command(config, out), stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while _completed(out) < 1 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)
    assert process.poll() is None, "the run ended before it could be killed in task 2"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert _completed(out) == 1
    assert not (out / "checkpoints" / "task-02-cipher").exists()

    subprocess.run(_command(config, out), check=True, stdout=subprocess.DEVNULL)
    full = json.loads((tmp_path / "full" / "results.json").read_text())
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["probe_accuracy"] == full["probe_accuracy"]
    assert not list(out.rglob(".tmp*")) or all(
        p.name.startswith(".tmp-") for p in out.rglob(".tmp*")
    )


def test_demo_shows_forgetting(tmp_path: Path) -> None:
    """The built-in demo (cached tiny base): seq_ft forgets the sequence and the probes."""
    subprocess.run(
        [sys.executable, "-m", "forgetless.cli.app", "run", "--out", str(tmp_path), "--quiet"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    metrics = json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert metrics["bwt"] < 0
    assert metrics["retention"] < 1
