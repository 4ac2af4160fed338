"""Non-finite steps under DeepSpeed ZeRO-2 on 2 processes: the engine skips them, on record.

The processes are started here (``torch.multiprocessing``) with the environment ``accelerate
launch --use_deepspeed`` sets, so the run can take a method object that plants the fault.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import tiny_run_config
from rich.console import Console
from test_nonfinite import NaNAt, _weights

from forgetless.config.loading import validate_config
from forgetless.core import distributed, zero
from forgetless.training.runner import Runner

pytestmark = pytest.mark.slow


def _worker(rank: int, model_dir: str, out: str, port: int, grad: bool) -> None:
    os.environ.update(zero.launch_env(rank, 2, port, stage=2), OMP_NUM_THREADS="1")
    distributed.start()
    train = {"steps": 3, "batch_size": 8, "lr": 1e-2, "max_length": 32, "on_nonfinite": "skip"}
    cfg = validate_config(tiny_run_config(Path(model_dir), train=train, probes=[]))
    method = NaNAt(task=1, steps={0, 1, 2}, grad=grad)
    runner = Runner(cfg, Path(out), Console(quiet=True), progress=False, method=method)
    runner.run()


@pytest.mark.parametrize("grad", [False, True], ids=["nan-loss", "nan-gradient"])
def test_zero_skips_every_non_finite_step_and_leaves_the_weights(
    tiny_model_dir: Path, tmp_path: Path, grad: bool
) -> None:
    """Every step of task 1 is non-finite (a NaN loss term, or a finite term with a NaN
    gradient): the engine skips each, the weights after task 1 are the base's, and task 2
    trains through a fresh engine as usual."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is installed apart: make deepspeed")
    port = 29600 + os.getpid() % 300 + (1 if grad else 0)
    mp.spawn(_worker, args=(str(tiny_model_dir), str(tmp_path), port, grad), nprocs=2)
    results = json.loads((tmp_path / "results.json").read_text())
    first, second = results["per_task"]
    assert first["parallel"] == second["parallel"] == "zero2"
    assert first["skipped_steps"] == 3 and "skipped_steps" not in second
    base = _weights(tiny_model_dir / "model.safetensors")
    after = _weights(tmp_path / "checkpoints/task-01-reverse/model.safetensors")
    assert all(torch.equal(after[k], base[k]) for k in base), "a skipped step changed a weight"
    trained = _weights(tmp_path / "checkpoints/task-02-cipher/model.safetensors")
    assert any(not torch.equal(trained[k], base[k]) for k in base), "task 2 trains as usual"
