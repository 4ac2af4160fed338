"""Run the forgetless CLI in subprocesses: plainly, under a planted SIGKILL, or on 2 processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from safetensors.torch import load_file

HARNESS = Path(__file__).with_name("crash_harness.py")
ACCELERATE = Path(sys.executable).with_name("accelerate")
FSDP_CONFIG = (
    Path(__file__).resolve().parents[1] / "examples" / "accelerate" / "cpu_2proc_fsdp2.yaml"
)
"""The shipped CPU FSDP2 config: the sharded test runs what a user would launch."""
ZERO_CONFIG = FSDP_CONFIG.with_name("cpu_2proc_zero2.yaml")
"""The shipped CPU DeepSpeed ZeRO-2 config (ZeRO-1 by overriding its stage)."""


def write_config(folder: Path, raw: dict[str, Any]) -> Path:
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def run_args(config: Path, out: Path) -> list[str]:
    return ["run", str(config), "--out", str(out), "--quiet"]


def cli(config: Path, out: Path) -> None:
    command = [sys.executable, "-m", "forgetless", *run_args(config, out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def killed_at(point: str, n: int, config: Path, out: Path) -> None:
    """Run with a SIGKILL planted at the ``n``-th time the run reaches ``point``."""
    command = [sys.executable, str(HARNESS), point, str(n), *run_args(config, out)]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert done.returncode == -signal.SIGKILL, (
        f"the run was not killed at {point} #{n} (exit {done.returncode}): {done.stderr[-2000:]}"
    )


def two_processes(
    config: Path,
    out: Path,
    fsdp: bool = False,
    killed_at: tuple[str, int] | None = None,
    zero: int | None = None,
) -> str:
    """``accelerate launch`` with 2 processes (torchrun underneath; gloo on a CPU machine),
    data-parallel, sharded with an FSDP version 2 config (``fsdp``), or under DeepSpeed ZeRO
    stage ``zero``; with ``killed_at``, each process is SIGKILLed at that point (the crash
    harness) and the launch must fail."""
    mode = ["--config_file", str(FSDP_CONFIG)] if fsdp else ["--multi_gpu"]
    if zero is not None:
        mode = ["--config_file", str(ZERO_CONFIG), "--zero_stage", str(zero)]
    target = ["-m", "forgetless"]
    if killed_at is not None:
        target = [str(HARNESS), killed_at[0], str(killed_at[1])]
    command = [
        str(ACCELERATE),
        "launch",
        *mode,
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(29500 + os.getpid() % 1000),
        *target,
        *run_args(config, out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert (done.returncode != 0) == (killed_at is not None), done.stderr[-3000:]
    return done.stdout + done.stderr


def results(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "results.json").read_text(encoding="utf-8"))
    return data


def step_losses(out: Path) -> list[list[float]]:
    return [task["losses"] for task in results(out)["per_task"]]


def final_state(out: Path) -> dict[str, Any]:
    """The last task checkpoint's method state and trained weights, by file and tensor name."""
    last = sorted((out / "checkpoints").glob("task-*"))[-1]
    return {
        str(path.relative_to(last)): load_file(str(path)) for path in last.rglob("*.safetensors")
    }


def assert_whole(out: Path) -> None:
    """No temp file or step checkpoint left, every JSON and safetensors file readable."""
    leftovers = [p for p in out.rglob("*") if ".tmp" in p.name or p.name.startswith("step-")]
    assert not leftovers, leftovers
    for path in out.rglob("*.json"):
        json.loads(path.read_text(encoding="utf-8"))
    for path in out.rglob("*.safetensors"):
        load_file(str(path))
