"""`train.optimizer_restarts`: the matched control for a method that restarts its optimizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console

from forgetless.config.loading import validate_config
from forgetless.contract.plan import TrainPlan
from forgetless.engine import loop
from forgetless.training.runner import Runner


@pytest.mark.parametrize(
    ("steps", "restarts", "expected"),
    [(100, 0, set()), (100, 4, {20, 40, 60, 80}), (10, 2, {3, 7}), (2, 5, {1, 2})],
)
def test_restart_steps_are_evenly_spaced(steps: int, restarts: int, expected: set[int]) -> None:
    plan = TrainPlan(steps=steps, batch_size=1, lr=1.0, seed=0, optimizer_restarts=restarts)
    assert plan.restart_steps() == expected


def _last_step_counts(
    model_dir: Path, out: Path, restarts: int, monkeypatch: pytest.MonkeyPatch
) -> set[int]:
    made: list[torch.optim.Optimizer] = []
    real = loop.make_optimizer

    def spy(params: Any, plan: TrainPlan) -> torch.optim.Optimizer:
        made.append(real(params, plan))
        return made[-1]

    monkeypatch.setattr(loop, "make_optimizer", spy)
    raw = tiny_run_config(model_dir, tasks=["reverse"])
    raw["train"] = {**raw["train"], "steps": 6, "optimizer_restarts": restarts}
    Runner(validate_config(raw), out, Console(quiet=True), progress=False).run()
    return {int(state["step"]) for state in made[-1].state.values()}


def test_a_restart_clears_the_moments_and_the_step_count(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _last_step_counts(tiny_model_dir, tmp_path / "a", 0, monkeypatch) == {6}
    assert _last_step_counts(tiny_model_dir, tmp_path / "b", 2, monkeypatch) == {2}
