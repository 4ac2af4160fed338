"""The one place that knows a run's output folder: its files, and checkpoint paths proved to stay
inside it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from forgetless.errors import ConfigError

CONFIG_FILE = "config.yaml"
RESULTS_FILE = "results.json"
CHECKPOINTS = "checkpoints"


def inside(root: Path, *parts: str) -> Path:
    """``root / parts...``, refused unless it resolves to a place inside ``root``."""
    path = root.joinpath(*parts)
    resolved, base = path.resolve(), root.resolve()
    if resolved == base or base not in resolved.parents:
        raise ConfigError(f"{path}: resolves to {resolved}, outside the output folder {base}")
    return path


@dataclass(frozen=True)
class RunDir:
    """A run's folder: ``config.yaml``, ``results.json`` and ``checkpoints/`` with one
    ``task-NN-<task>`` folder per finished task and ``step-NN-<task>`` inside a task."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def results(self) -> Path:
        return self.root / RESULTS_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def task_checkpoint(self, index: int, name: str) -> Path:
        """The checkpoint written when task ``index`` (1-based) named ``name`` finished."""
        return inside(self.root, CHECKPOINTS, f"task-{index:02d}-{name}")

    def step_checkpoint(self, index: int, name: str) -> Path:
        """The step checkpoint of task ``index`` while it trains."""
        return inside(self.root, CHECKPOINTS, f"step-{index:02d}-{name}")

    def task_checkpoints(self, names: list[str]) -> list[Path]:
        """The finished tasks' checkpoints, in order."""
        return [self.task_checkpoint(i, n) for i, n in enumerate(names, start=1)]

    def has_step_checkpoints(self) -> bool:
        return self.checkpoints.is_dir() and any(self.checkpoints.glob("step-*"))
