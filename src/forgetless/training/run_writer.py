"""What a run leaves in its folder and on screen: ``config.yaml``, ``results.json``, the task
checkpoints, the trackers' logs and one line per finished task."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from forgetless.config.loading import dump_config
from forgetless.config.schema import RunConfig, probe_names
from forgetless.contract.plan import TrainStats
from forgetless.core import distributed
from forgetless.core.rundir import RunDir
from forgetless.core.storage import atomic_dir, atomic_write_text, save_method_state
from forgetless.engine.tracking import Tracker
from forgetless.training.results import Results


@dataclass
class RunWriter:
    """Writes a run's folder (only the main process writes) and reports its progress."""

    out_dir: Path
    console: Console
    tracker: Tracker

    @classmethod
    def open(cls, cfg: RunConfig, out_dir: Path, console: Console) -> RunWriter:
        report_to = cfg.report_to if distributed.is_main_process() else "none"
        return cls(out_dir, console, Tracker(report_to, out_dir, cfg.model_dump(mode="json")))

    def say(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    @contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """A phase without a bar: a spinner on a terminal; into a log, a line as it starts and
        one as it ends, so a run under nohup is never silent for its whole length."""
        if self.console.is_terminal:
            with self.console.status(label):
                yield
            return
        start = time.perf_counter()
        self.say(f"{label}: start")
        yield
        self.say(f"{label}: done in {time.perf_counter() - start:.0f}s")

    def start(
        self, cfg: RunConfig, tasks: list[str], stored: Results | None, inputs: dict[str, Any]
    ) -> Results:
        """Write the config, and the results to go on from (``stored``, or a fresh start)."""
        resolved = cfg.model_dump(mode="json")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(RunDir(self.out_dir).config, dump_config(cfg))
        if stored is None:
            return Results(resolved, tasks, probe_names(cfg.probes), inputs=inputs)
        self._remove_steps(tasks[: stored.completed_tasks])
        stored.config, stored.inputs = resolved, inputs
        if stored.completed_tasks:
            self.say(f"Resuming after task {stored.completed_tasks} of {len(tasks)}")
        return stored

    def _remove_steps(self, finished: list[str]) -> None:
        """Step checkpoints of tasks that have finished (their task checkpoint supersedes)."""
        if not distributed.is_main_process():
            return
        for index, name in enumerate(finished, start=1):
            stale = RunDir(self.out_dir).step_checkpoint(index, name)
            if stale.is_dir():
                shutil.rmtree(stale)

    def task_checkpoints(self, names: list[str]) -> list[Path]:
        return RunDir(self.out_dir).task_checkpoints(names)

    @contextmanager
    def task_checkpoint(self, index: int, name: str) -> Iterator[Path]:
        """A folder that becomes task ``index``'s checkpoint, whole, when the block ends."""
        final = RunDir(self.out_dir).task_checkpoint(index, name)
        final.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(final) as tmp:
            yield tmp

    @staticmethod
    def save_state(folder: Path, state: dict[str, Any]) -> None:
        save_method_state(folder, state)

    def task_done(self, index: int, name: str, results: Results) -> None:
        """Write the results with the task's row; its step checkpoint is no longer needed."""
        results.write(self.out_dir)
        step_dir = RunDir(self.out_dir).step_checkpoint(index, name)
        if distributed.is_main_process() and step_dir.is_dir():
            shutil.rmtree(step_dir)
        self.tracker.log_metrics(results.metrics())

    def report_task(self, index: int, task: str, stats: TrainStats, results: Results) -> None:
        row = results.accuracy[-1]
        accs = ", ".join(f"{escape(t)} {a:.2f}" for t, a in zip(results.tasks, row, strict=True))
        probes = ", ".join(
            f"{escape(p)} {a:.2f}"
            for p, a in zip(results.probes, results.probe_accuracy[-1], strict=True)
        )
        self.console.print(
            f"[bold]task {index}/{len(results.tasks)} {escape(task)}[/]: {stats.steps} steps in "
            f"{stats.seconds:.1f}s ({stats.steps_per_second:.1f}/s) | tasks: {accs}"
            + (f" | probes: {probes}" if probes else "")
        )
