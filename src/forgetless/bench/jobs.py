"""Bench runs spread over worker processes on one machine (``forgetless bench --jobs N``).

Each run is independent (its own config, seed and folder), so N workers can take them in any
order. Each worker process runs one run at a time with a fixed number of CPU threads, so a run's
result does not depend on N; the parent keeps the plan's order when it aggregates, so
``bench.json`` is the same as a sequential sweep's (wall times aside).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

Job = tuple[int, dict[str, Any], Path]
"""(position in the plan, the run's validated config as JSON data, its output folder)."""


def threads_per_job(jobs: int, threads: int | None) -> int:
    """The CPU threads each run gets: ``threads``, or the machine's cores shared out evenly."""
    if threads is not None:
        return threads
    return max(1, (os.cpu_count() or 1) // jobs)


def run_job(config: dict[str, Any], folder: str, threads: int) -> dict[str, Any]:
    """One run in a worker process: its results as JSON data."""
    import torch
    from rich.console import Console

    from forgetless.config.loading import validate_config
    from forgetless.training.runner import Runner

    torch.set_num_threads(threads)
    cfg = validate_config(config, f"bench run {folder}")
    return Runner(cfg, Path(folder), Console(quiet=True), progress=False).run().to_json()


def run_parallel(
    jobs: list[Job],
    workers: int,
    threads: int,
    on_done: Callable[[int, dict[str, Any]], None],
) -> None:
    """Run ``jobs`` on ``workers`` processes (spawned: no state is shared with the parent) and
    call ``on_done(position, results)`` in the parent as each finishes. A failing run stops the
    sweep with its error once the runs already started have ended."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        pending: dict[Future[dict[str, Any]], int] = {
            pool.submit(run_job, config, str(folder), threads): position
            for position, config, folder in jobs
        }
        for future in as_completed(pending):
            on_done(pending[future], future.result())
