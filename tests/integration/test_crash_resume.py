"""A SIGKILL in the middle of a training step: the re-run resumes inside the task, from its last
step checkpoint, and ends where an uninterrupted run ends (the slow tier kills at more points)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_runs import assert_whole, cli, final_state, killed_at, results, write_config
from conftest import tiny_run_config

from forgetless.contract import create_method
from forgetless.engine.loop import batches
from forgetless.engine.step_checkpoint import LoopProgress, StepCheckpointer
from forgetless.errors import CheckpointError
from forgetless.methods.seq_ft import SeqFTConfig


def test_sigkill_mid_step_resumes_from_the_step_checkpoint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    train = {"steps": 6, "batch_size": 8, "lr": 1e-3, "max_length": 32, "checkpoint_every": 2}
    config = write_config(tmp_path, tiny_run_config(tiny_model_dir, train=train))
    cli(config, tmp_path / "full")

    out = tmp_path / "killed"
    killed_at("step", 6 + 4, config, out)  # task 2, step 4 (0-based 3): after its step-2 save
    saved = json.loads((out / "checkpoints" / "step-02-cipher" / "step_state.json").read_text())
    assert saved["progress"]["step"] == 2
    assert results(out)["completed_tasks"] == 1

    cli(config, out)
    full, resumed = results(tmp_path / "full"), results(out)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["probe_accuracy"] == full["probe_accuracy"]
    for key in ("losses", "padding_fraction"):  # padding: counted on from the resumed step
        assert [t[key] for t in resumed["per_task"]] == [t[key] for t in full["per_task"]], key
    for name, tensors in final_state(tmp_path / "full").items():
        again = final_state(out)[name]
        assert all(torch.equal(tensors[k], again[k]) for k in tensors), name
    assert_whole(out)


def test_skipped_batches_replay_the_data_order() -> None:
    features = [{"input_ids": [i]} for i in range(10)]
    stream = batches(features, 3, seed=7)  # type: ignore[arg-type]
    drawn = [next(stream) for _ in range(8)]
    for skip in (0, 1, 3, 4, 7):
        resumed = batches(features, 3, seed=7, skip=skip)  # type: ignore[arg-type]
        assert [next(resumed) for _ in range(8 - skip)] == drawn[skip:]


def _loop_objects(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Linear(width, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def test_step_checkpoint_round_trips_and_refuses_another_model(tmp_path: Path) -> None:
    method = create_method(SeqFTConfig(name="seq_ft"))
    saver = StepCheckpointer(tmp_path / "step", 2, method, {"steps": 4})
    model, optimizer, scheduler = _loop_objects(5)
    saver.save(model, optimizer, scheduler, LoopProgress(step=2, losses=[1.0, 0.5]))
    expected = torch.rand(3)

    again, opt_again, sched_again = _loop_objects(5)
    done = saver.resume(again, opt_again, sched_again)
    assert done is not None and done.step == 2 and done.losses == [1.0, 0.5]
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    state, state_again = optimizer.state_dict()["state"], opt_again.state_dict()["state"]
    assert all(torch.equal(state[i]["exp_avg_sq"], state_again[i]["exp_avg_sq"]) for i in state)
    assert torch.equal(torch.rand(3), expected)  # the RNG is where it was at the save

    other = StepCheckpointer(tmp_path / "step", 2, method, {"steps": 5})
    assert other.resume(*_loop_objects(5)) is None  # another plan: not resumed
    with pytest.raises(CheckpointError, match=r"step_state\.safetensors: tensor '0\.weight' has"):
        saver.resume(*_loop_objects(7))
