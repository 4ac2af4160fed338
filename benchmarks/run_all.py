"""Run every benchmark, then write ``benchmarks/RESULTS.md`` and ``benchmarks/RESULTS.json``.

Called by ``benchmarks/run``. Each benchmark is its own script, run here one after another (never
two at once: they would time each other) with its report in ``--results``; every timing in them
is a ratio of medians measured side by side within that script. Torch runs on ``--threads``
threads (1 by default: on a shared machine a second OpenMP thread that loses its core spins,
and a 2-thread step can take ten times as long), except in the demo's wall time, which runs
as a user runs it, on the default threads. ``--quick`` shrinks every benchmark (fewer
steps and repeats, small geometry widths), times the demo once, and skips the bench demo's
cold and warm runs and the SAE-FD anchor-precision study.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from results_table import render  # benchmarks/ is on sys.path

from forgetless.core.storage import atomic_write_json, atomic_write_text

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Job:
    """One benchmark: its script, its arguments (full run, quick run) and its report's name."""

    name: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...] | None
    """None: skipped by ``--quick``."""
    pinned: bool = True
    """False: on the machine's default threads, as a user runs it (the demo's wall time)."""


JOBS = (
    Job("throughput", "throughput.py", ("--steps", "200"), ("--steps", "100")),
    Job("method_steps", "method_steps.py", ("--steps", "30"), ("--steps", "12", "--repeats", "2")),
    Job(
        "task_growth",
        "task_growth.py",
        ("--steps", "20", "--control-steps", "8", "--past-n-train", "64"),
        ("--steps", "12", "--control-steps", "4", "--repeats", "1", "--past-n-train", "64"),
    ),
    Job("anchored_overhead", "anchored_overhead.py", ("--steps", "60"), ("--steps", "20")),
    Job("sae_fd_overhead", "sae_fd_overhead.py", ("--steps", "50"), ("--steps", "20")),
    Job("attribution_overhead", "attribution_overhead.py", ("--steps", "60"), ("--steps", "20")),
    Job("geometry_scaling", "geometry_scaling.py", ("--ranks", "8,64"), ("--quick",)),
    Job("circuits_speed", "circuits_speed.py", (), ("--repeats", "2")),
    Job("demo_time", "demo_time.py", (), ("--repeats", "1"), pinned=False),
    Job("demo_bench_time", "demo_time.py", ("--bench",), None, pinned=False),
    Job("sae_fd_anchor_precision", "sae_fd_anchor_precision.py", (), None, pinned=False),
)


def commit() -> str:
    """The checked-out commit the numbers were measured at ('' outside a git checkout)."""
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def machine(threads: int) -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    from forgetless.core.machine import cpu_name

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "os": f"{platform.system()} {platform.release()}",
    }


def machine_words(m: dict[str, Any]) -> str:
    """``machine()``'s record as a table's footer names it."""
    return (
        f"{m['cpu']} ({m['cores']} cores, {m['torch_threads']} torch thread(s), torch {m['torch']})"
    )


def load_words(load: dict[str, float]) -> str:
    """The 1-minute load average around a measurement: whether other jobs shared the cores."""
    return f"1-minute load average {load['before']:.1f} before, {load['after']:.1f} after"


def run_job(job: Job, quick: bool, results: Path, threads: int) -> dict[str, Any]:
    """Run one benchmark script; its report (or why there is none) and its wall time."""
    args = job.quick if quick else job.full
    if args is None:
        return {"skipped": "--quick"}
    out = results / f"{job.name}.json"
    command = [sys.executable, str(HERE / job.script), *args, "--out", str(out)]
    env = dict(os.environ)
    if job.pinned:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    print(f"[{time.strftime('%H:%M:%S')}] {job.name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    seconds = round(time.perf_counter() - start, 1)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["failed"])[-1]
        print(f"  failed after {seconds}s: {tail}", flush=True)
        return {"error": tail, "seconds": seconds}
    print(f"  done in {seconds}s", flush=True)
    return {"report": json.loads(out.read_text()), "seconds": seconds, "file": str(out)}


def kept(job: Job, results: Path) -> dict[str, Any]:
    """A report an earlier run left in ``results`` (``--render-only``)."""
    out = results / f"{job.name}.json"
    if not out.exists():
        return {"error": f"no report {out.name}"}
    stamp = datetime.fromtimestamp(out.stat().st_mtime, UTC).strftime("%H:%M UTC")
    return {"report": json.loads(out.read_text()), "file": str(out), "written": stamp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shrink everything; skip the demo")
    parser.add_argument("--only", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per benchmark")
    parser.add_argument("--results", type=Path, default=HERE / "results", help="reports folder")
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md", help="the table")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: rebuild the table from the reports already in --results",
    )
    args = parser.parse_args()
    wanted = set(args.only.split(",")) if args.only else {j.name for j in JOBS}
    args.results.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC)
    tick = time.perf_counter()
    sections = {
        j.name: kept(j, args.results)
        if args.render_only
        else run_job(j, args.quick, args.results, args.threads)
        for j in JOBS
        if j.name in wanted
    }
    summary = {
        "schema_version": 1,
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": "benchmarks/run" + (" --quick" if args.quick else ""),
        "render_only": args.render_only,
        "quick": args.quick,
        "machine": machine(args.threads),
        "wall_seconds": round(time.perf_counter() - tick, 1),
        "sections": sections,
    }
    table, figures = render(summary)
    summary["figures"] = figures
    for section in sections.values():  # the full reports are the files in --results
        section.pop("report", None)
    atomic_write_json(args.out.with_suffix(".json"), summary)
    atomic_write_text(args.out, table)
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
