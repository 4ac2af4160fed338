"""The pieces several methods share: the base-model loader's guard, the frozen reference, and the
continual merge base that leaves a merge method only its increment."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from forgetless.contract.hooks import RunInfo, Stage
from forgetless.contract.plan import TrainStats
from forgetless.core.modules import freeze, trainable_parameters
from forgetless.errors import ModelLoadError
from forgetless.methods.continual_merge import ContinualMerge, Tensors
from forgetless.strict import MethodConfig


def _run_info(load_base: Any = None) -> RunInfo:
    return RunInfo(
        seed=0,
        out_dir=Path("."),
        task_names=["t"],
        probe_names=[],
        finetune_mode="full",
        load_base=load_base,
    )


def test_base_loader_names_the_method_when_the_runner_gave_none() -> None:
    with pytest.raises(ModelLoadError, match="kl_sft needs the runner's base-model loader"):
        _run_info().base_loader("kl_sft")


def test_base_loader_is_the_runners_loader() -> None:
    def load() -> nn.Module:
        return nn.Linear(2, 2)

    assert _run_info(load).base_loader("kl_sft") is load


def test_freeze_gives_back_the_module_in_eval_mode_without_gradients() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    frozen = freeze(model)
    assert frozen is model and not model.training
    assert not trainable_parameters(model)


class _Halves(ContinualMerge[MethodConfig]):
    """A merge that keeps half of each update and records how many weights it saw."""

    name = "halves"

    def increment(self, deltas: Tensors, details: dict[str, Any]) -> Tensors:
        details["weights"] = len(deltas)
        return {n: 0.5 * d for n, d in deltas.items()}


def test_a_continual_merge_writes_only_its_increment() -> None:
    model = nn.Linear(4, 3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    update = {n: torch.full_like(p, 2.0) for n, p in model.named_parameters()}

    def sft(**_: Any) -> TrainStats:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.add_(update[n])
        return TrainStats(steps=1)

    ctx = SimpleNamespace(model=model)
    stage = Stage(ctx=ctx, sft=sft, out_dir=Path("."), plan=None)  # type: ignore[arg-type]
    stats = _Halves(MethodConfig(name="halves")).train_task(stage)
    for n, p in model.named_parameters():
        assert torch.allclose(p, start[n] + 1.0)
    assert stats.steps == 1 and stats.details == {"weights": 2}
    assert _Halves.carry_only == "merges the trainable weights"
