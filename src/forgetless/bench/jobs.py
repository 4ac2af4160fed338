"""Bench runs spread over worker processes on one machine (``forgetless bench --jobs N``).

Each run is independent (its own config, seed and folder), so N workers can take them in any
order. Each worker process runs one run at a time with a fixed number of CPU threads (and, on a
GPU machine, its own device), so a run's result does not depend on N; the parent keeps the
plan's order when it aggregates, so ``bench.json`` is the same as a sequential sweep's (wall
times aside).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgetless.engine.progress import duration
from forgetless.errors import ConfigError

Job = tuple[int, dict[str, Any], Path]
"""(position in the plan, the run's validated config as JSON data, its output folder)."""

LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""Set by torchrun / accelerate launch: a worker must not join the launcher's process group."""

WORKER_LOGS = "worker-logs"
"""The bench folder's sub-folder where each worker's run writes what a run prints."""

INTERRUPTED = "interrupted: the run stopped here; re-running the bench resumes it"
"""What a worker's log ends with when a Ctrl-C stopped its run."""

_worker_slot = 0


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (a container's or ``taskset``'s
    share) where the system has one, else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_job(jobs: int, threads: int | None) -> int:
    """The CPU threads each run gets: ``threads``, or the usable cores shared out evenly."""
    if threads is not None:
        return threads
    return max(1, usable_cores() // jobs)


def oversubscribed(jobs: int, threads: int | None) -> str | None:
    """One warning line when ``jobs`` runs of ``threads`` threads each need more cores than
    this process may use (their threads then take turns: every run slower, timings noisier)."""
    per_job, cores = threads_per_job(jobs, threads), usable_cores()
    if jobs * per_job <= cores:
        return None
    fix = (
        f"--threads {cores // jobs} (or fewer --jobs)"
        if cores >= jobs
        else f"--jobs {cores} --threads 1"
    )
    return (
        f"warning: --jobs {jobs} × {per_job} thread(s) per run = {jobs * per_job} threads on "
        f"{cores} usable cores: running anyway, but the runs take turns on the cores (each "
        f"slower, timings noisier); set {fix} to fit"
    )


def check_jobs(jobs: int) -> None:
    """``--jobs`` spreads runs over local processes; under a distributed launch every rank
    would start its own pool, so it is refused there."""
    if jobs > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("bench --jobs: not under a distributed launch (WORLD_SIZE > 1)")


def _start_worker(counter: Any) -> None:
    """Each worker takes the next slot: its GPU on a GPU machine (slot mod device count)."""
    global _worker_slot
    with counter.get_lock():
        _worker_slot = counter.value
        counter.value += 1
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)


def worker_log(folder: Path) -> Path:
    """Where the run in ``folder`` (``BENCH/variant/sN``) writes its output and progress lines."""
    return folder.parent.parent / WORKER_LOGS / f"{folder.parent.name}-{folder.name}.log"


def run_job(
    config: dict[str, Any], folder: str, threads: int, quiet: bool = False
) -> dict[str, Any]:
    """One run in a worker process: its results as JSON data. What it prints, progress lines
    included, goes to its ``worker_log`` (appended to on a resume); the bench's own output gets
    one line naming that log, so a long parallel bench can be followed run by run."""
    import torch
    from rich.console import Console

    from forgetless.config.loading import validate_config
    from forgetless.training.runner import Runner

    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        torch.cuda.set_device(_worker_slot % torch.cuda.device_count())
    cfg = validate_config(config, f"bench run {folder}")
    log = worker_log(Path(folder))
    log.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"started {log.stem} (its output and progress: {log})", flush=True)
    with log.open("a", encoding="utf-8", buffering=1) as handle:
        console = Console(file=handle, force_terminal=False, no_color=True, width=110)
        try:
            return Runner(cfg, Path(folder), console).run().to_json()
        except KeyboardInterrupt:
            handle.write(f"{INTERRUPTED}\n")  # a Ctrl-C is no fault: no traceback to read
            raise
        except BaseException:
            handle.write(traceback.format_exc())  # the bench shows one line; the log, the rest
            raise


def pace_text(done: int, total: int, elapsed: float) -> str:
    """``3 of 15 runs; about 4h10m left at the pace so far``: wall time per finished run, the
    workers together and start-ups included, times the runs left."""
    if done >= total or done <= 0:
        return f"{done} of {total} runs"
    left = duration(elapsed / done * (total - done))
    return f"{done} of {total} runs; about {left} left at the pace so far"


@dataclass
class Pace:
    """Counts finished runs against the wall clock, from when the runs were sent off."""

    total: int
    done: int = 0
    start: float = field(default_factory=time.monotonic)

    def tick(self) -> str:
        self.done += 1
        return pace_text(self.done, self.total, time.monotonic() - self.start)


def run_parallel(
    jobs: list[Job],
    workers: int,
    threads: int,
    on_done: Callable[[int, dict[str, Any]], None],
    quiet: bool = False,
) -> None:
    """Run ``jobs`` on ``workers`` spawned processes (no state shared with the parent) and call
    ``on_done(position, results)`` in the parent as each finishes. A failing run cancels the
    runs not started yet and raises once the running ones have ended."""
    context = multiprocessing.get_context("spawn")
    counter = context.Value("i", 0)
    with ProcessPoolExecutor(workers, context, _start_worker, (counter,)) as pool:
        pending: dict[Future[dict[str, Any]], tuple[int, Path]] = {
            pool.submit(run_job, config, str(folder), threads, quiet): (position, folder)
            for position, config, folder in jobs
        }
        try:
            for future in as_completed(pending):
                position, folder = pending[future]
                on_done(position, _result(future, folder))
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def _result(future: Future[dict[str, Any]], folder: Path) -> dict[str, Any]:
    """A finished run's results; a failed run's error, after a line naming its log."""
    try:
        return future.result()
    except Exception:
        print(f"bench run {folder} failed; its log: {worker_log(folder)}", file=sys.stderr)
        raise
