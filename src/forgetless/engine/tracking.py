"""Experiment tracking through accelerate's trackers (``report_to``: tensorboard, wandb, ...)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from forgetless.errors import ConfigError

PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "trackio": "trackio",
}


class Tracker:
    """Logs each named loss term per step and the metrics after each task; ``none`` logs nothing."""

    def __init__(self, report_to: str, out_dir: Path, config: dict[str, Any]) -> None:
        self.step = 0
        self._accelerator: Any = None
        if report_to == "none":
            return
        package = PACKAGES[report_to]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"report_to: {report_to} needs the {package!r} package (pip install {package})"
            )
        from accelerate import Accelerator

        self._accelerator = Accelerator(log_with=report_to, project_dir=str(out_dir / "tracking"))
        self._accelerator.init_trackers("forgetless", config=_flatten(config))

    @property
    def active(self) -> bool:
        return self._accelerator is not None

    def log_step(self, task: str, values: dict[str, float]) -> None:
        self.step += 1
        if self.active:
            self._accelerator.log(
                {f"train/{task}/{k}": v for k, v in values.items()}, step=self.step
            )

    def log_metrics(self, values: dict[str, Any]) -> None:
        if self.active:
            flat = {
                f"eval/{k}": v for k, v in _flatten(values).items() if isinstance(v, (int, float))
            }
            self._accelerator.log(flat, step=self.step)

    def finish(self) -> None:
        if self.active:
            self._accelerator.end_training()


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[f"{prefix}{key}"] = value
        else:
            out[f"{prefix}{key}"] = str(value)
    return out
