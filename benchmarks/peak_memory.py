"""Shared by the overhead benchmarks: their common options, one case per subprocess, and the
peak memory of the code timed in that subprocess.

CUDA's allocator peak on a GPU. On the CPU the kernel's resident-set high-water mark (``VmHWM``),
reset after the warm-up where Linux allows it, so that the peak is the timed steps' and not the
imports' (which outweigh a tiny model); else ``ru_maxrss``, which never goes down.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def status_kb(field: str) -> float | None:
    """A ``/proc/self/status`` memory field in KiB (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return float(line.split()[1])
    except OSError:
        return None
    return None


def start_window(device: torch.device) -> bool:
    """Start the measured window: reset the peak; True when the CPU high-water mark was reset."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return False
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return status_kb("VmHWM") is not None


def peak_mb(device: torch.device, hwm_reset: bool) -> tuple[float, str]:
    """The window's peak in MiB and how it was measured (cuda, vmhwm or ru_maxrss)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20, "cuda"
    if hwm_reset:
        return (status_kb("VmHWM") or 0.0) / 2**10, "vmhwm"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), "ru_maxrss"


def add_step_args(parser: argparse.ArgumentParser, out: Path) -> None:
    """Options every overhead benchmark takes: timed steps, repeats, batch, data, threads, out."""
    parser.add_argument("--steps", type=int, default=100, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", type=Path, default=out, help="where the JSON report goes")


def run_case(script: str, case_args: list[str], args: argparse.Namespace, flags: list[str]) -> Any:
    """One case of ``script`` in a fresh interpreter; its last stdout line is the JSON record."""
    command = [sys.executable, script, *case_args]
    for flag in flags:
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_forked(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a forked child (POSIX): a fresh process whose memory peak is its own
    from the window ``start_window`` opens, without paying the imports again. The parent must
    not have started a thread pool (fork copies one thread); the result travels as JSON."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        code = 0
        try:
            payload = json.dumps({"ok": fn(*args)})
        except BaseException as err:  # reported to the parent, which raises it
            payload, code = json.dumps({"error": f"{type(err).__name__}: {err}"}), 1
        with os.fdopen(write, "w") as out:
            out.write(payload)
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as src:
        payload = src.read()
    os.waitpid(pid, 0)
    result = json.loads(payload) if payload else {"error": "the child died without a result"}
    if "error" in result:
        raise RuntimeError(
            f"forked case {getattr(fn, '__name__', fn)}{args[:2]}: {result['error']}"
        )
    return result["ok"]


def timed_steps(loop: Any, features: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """Warm ``loop`` up for ``args.warmup`` steps, then time ``args.steps`` steps one by one and
    measure the window's peak memory: ``{"times": [...], "peak_mb": ..., "memory": ...}``."""
    from forgetless.contract.plan import TrainPlan

    stamps: list[float] = []
    loop.on_step = lambda name, terms: stamps.append(time.perf_counter())
    device = loop.ctx.device
    loop.run(features, TrainPlan(steps=args.warmup, batch_size=args.batch_size, lr=1e-3, seed=0))
    hwm_reset = start_window(device)
    stamps.clear()
    start = time.perf_counter()
    loop.run(features, TrainPlan(steps=args.steps, batch_size=args.batch_size, lr=1e-3, seed=1))
    times = [b - a for a, b in zip([start, *stamps[:-1]], stamps, strict=True)]
    peak, measure = peak_mb(device, hwm_reset)
    return {"times": times, "peak_mb": peak, "memory": measure}
