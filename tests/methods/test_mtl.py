"""Joint multi-task training: one stage on every task's data, nothing after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import tiny_run_config
from rich.console import Console

from forgetless.config.loading import validate_config
from forgetless.contract import registered_methods
from forgetless.contract.method import Stage
from forgetless.contract.plan import TrainStats
from forgetless.methods.mtl import MTL, MTLConfig, joint_steps
from forgetless.tasks.formatting import Features, encode_example
from forgetless.training.runner import Runner


class RecordingMTL(MTL):
    """Records what each stage hands to the shared loop."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.calls: list[tuple[int, list[Features], int]] = []
        self.sequences: list[list[Any]] = []
        self.tokenizer: Any = None

    def train_task(self, stage: Stage) -> TrainStats:
        sft = stage.sft
        self.sequences.append(stage.ctx.sequence)
        self.tokenizer = stage.ctx.tokenizer

        def recording(**kwargs: Any) -> TrainStats:
            self.calls.append((stage.ctx.task_index, kwargs["features"], kwargs["steps"]))
            return sft(**kwargs)

        stage.sft = recording
        return super().train_task(stage)


def test_mtl_trains_once_on_every_task(tiny_model_dir: Path, tmp_path: Path) -> None:
    method = RecordingMTL(MTLConfig(name="mtl"))
    cfg = validate_config(tiny_run_config(tiny_model_dir, method={"name": "mtl"}))
    results = Runner(cfg, tmp_path, Console(quiet=True), progress=False, method=method).run()
    out = results.to_json()
    assert [s["steps"] for s in out["per_task"]] == [2 * 4, 0]
    assert out["per_task"][1]["loss_terms"] == {}
    assert len(out["accuracy_matrix"]) == 3, "still evaluated after every task"
    [(index, features, steps)] = method.calls
    assert index == 1 and steps == 8
    tasks, tok = method.sequences[0], method.tokenizer
    assert [t.name for t in tasks] == ["reverse", "cipher"]
    expected = [encode_example(tok, e, 32) for t in tasks for e in t.train]
    assert features == expected and len(features) == 64
    per_task = [{tuple(encode_example(tok, e, 32)["input_ids"]) for e in t.train} for t in tasks]
    seen = {tuple(f["input_ids"]) for f in features}
    assert all(p <= seen for p in per_task) and not per_task[0] & per_task[1]


def test_mtl_is_marked_joint_and_registered() -> None:
    assert registered_methods()["mtl"] is MTL
    assert MTL.joint_training is True
    assert not getattr(registered_methods()["seq_ft"], "joint_training", False)
    assert joint_steps(5, 3) == 15
