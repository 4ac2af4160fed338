"""Bench runs sent to a cluster, one job per run (``forgetless bench --cluster slurm``).

The engine is submitit: Slurm is the scheduler of most of the clusters this field trains on,
and submitit submits a Python function as a Slurm job with nothing else to run (Ray would need
its own cluster, a head node and its workers, beside the scheduler). Each job runs one planned
run with the same function ``--jobs`` uses (``forgetless.bench.jobs.run_job``), into the run's
folder on shared storage; the bench polls the jobs, reads each finished run's ``results.json``
(never submitit's pickled return value) and aggregates in the plan's order, so ``bench.json`` is
a sequential sweep's. With ``--campaign`` a re-run submits only the runs not kept yet, and a run
folder a timed-out job left behind resumes where it stopped. ``--cluster local`` runs the same
jobs as processes on this machine (submitit's local executor), to try the launcher.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forgetless.bench.jobs import Job, run_job
from forgetless.bench.variants import ClusterSection
from forgetless.errors import ConfigError, ForgetlessError

EXECUTORS = ("slurm", "local")


class ClusterJobError(ForgetlessError):
    """A run's cluster job ended without a finished run."""


def _executor(kind: str, spec: ClusterSection, logs: Path) -> Any:
    try:
        import submitit
    except ImportError:
        raise ConfigError(
            "bench --cluster needs submitit: pip install 'forgetless[cluster]'"
        ) from None
    if kind not in EXECUTORS:
        raise ConfigError(f"bench --cluster: {kind!r} is not one of {', '.join(EXECUTORS)}")
    executor = submitit.AutoExecutor(folder=str(logs), cluster=None if kind == "slurm" else kind)
    extra: dict[str, Any] = {} if spec.mem_gb is None else {"mem_gb": spec.mem_gb}
    if kind == "slurm" and spec.partition:
        extra["slurm_partition"] = spec.partition
    executor.update_parameters(
        name="forgetless-bench",
        timeout_min=spec.timeout_min,
        cpus_per_task=spec.cpus_per_task,
        gpus_per_node=spec.gpus_per_task,
        tasks_per_node=1,
        nodes=1,
        **extra,
    )
    return executor


def finished_results(folder: Path) -> dict[str, Any] | None:
    """A run folder's results when the run finished every task, else None."""
    path = folder / "results.json"
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data if data.get("status") == "complete" else None


def run_on_cluster(
    jobs: list[Job],
    kind: str,
    spec: ClusterSection,
    logs: Path,
    on_done: Callable[[int, dict[str, Any]], None],
) -> None:
    """Submit one job per run and call ``on_done(position, results)`` as each run finishes.
    A job that ends without a finished run cancels the others and raises, naming its log."""
    executor = _executor(kind, spec, logs)
    with executor.batch():
        submitted = [
            (position, folder, executor.submit(run_job, config, str(folder), spec.cpus_per_task))
            for position, config, folder in jobs
        ]
    pending = list(submitted)
    try:
        while pending:
            for item in [p for p in pending if p[2].done()]:
                position, folder, job = item
                results = finished_results(folder)
                if results is None:
                    raise ClusterJobError(
                        f"cluster job {job.job_id} ({folder}) ended without a finished run; "
                        f"its log: {job.paths.stderr}"
                    )
                pending.remove(item)
                on_done(position, results)
            if pending:
                time.sleep(spec.poll_seconds)
    except BaseException:
        for _, _, job in pending:
            job.cancel(check=False)
        raise
