from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import tiny_run_config
from rich.console import Console

from forgetless.config.loading import validate_config
from forgetless.engine import tracking
from forgetless.errors import ConfigError
from forgetless.training.runner import Runner


class Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.ended = False

    def log(self, values: dict[str, Any], step: int) -> None:
        self.logged.append((step, values))

    def end_training(self) -> None:
        self.ended = True


def test_named_loss_terms_and_task_metrics_are_logged(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()
    original = tracking.Tracker.__init__

    def fake_init(
        self: tracking.Tracker, report_to: str, out_dir: Path, config: dict[str, Any]
    ) -> None:
        original(self, "none", out_dir, config)
        self._accelerator = recorder

    monkeypatch.setattr(tracking.Tracker, "__init__", fake_init)
    cfg = validate_config(tiny_run_config(tiny_model_dir))
    Runner(cfg, tmp_path, Console(quiet=True), progress=False).run()
    train = [v for _, v in recorder.logged if any(k.startswith("train/") for k in v)]
    assert len(train) == 8 and set(train[0]) == {"train/reverse/loss", "train/reverse/task"}
    evals = [v for _, v in recorder.logged if "eval/average_accuracy" in v]
    assert len(evals) == 2 and "eval/kl_drift.base_to_model" in evals[-1]
    assert recorder.ended


def test_missing_tracker_package_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"report_to: wandb needs the 'wandb' package"):
        tracking.Tracker("wandb", tmp_path, {})
    assert not tracking.Tracker("none", tmp_path, {}).active
