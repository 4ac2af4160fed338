"""Numerical faults: a NaN/inf loss or gradient stops (default) or skips the step, on record."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from safetensors.torch import load_file

from forgetless.config.loading import validate_config
from forgetless.contract.method import Capability, Method, MethodConfig, StepContext, TaskContext
from forgetless.errors import TrainingError
from forgetless.training.runner import Runner

TRAIN = {"steps": 3, "batch_size": 8, "lr": 1e-2, "max_length": 32}


class FaultConfig(MethodConfig):
    name: Literal["fault"] = "fault"


class NaNAt(Method):
    """A probe method whose extra loss term is NaN (or has a NaN gradient) at given steps."""

    name = "fault"
    config_cls = FaultConfig
    capabilities = frozenset({Capability.LOSS_TERMS, Capability.TASK_START})

    def __init__(self, task: int, steps: set[int], grad: bool = False) -> None:
        super().__init__(FaultConfig())
        self.task, self.steps, self.grad = task, steps, grad
        self.digests: dict[str, str] = {}

    def on_task_start(self, ctx: TaskContext) -> None:
        """Fingerprint the checkpoints written so far, to check they survive the failure."""
        for path in sorted((ctx.run.out_dir / "checkpoints").rglob("*")):
            if path.is_file():
                self.digests[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()

    def loss_terms(self, batch: Any, outputs: Any, ctx: StepContext) -> dict[str, torch.Tensor]:
        zero = outputs.logits.sum() * 0.0
        if (ctx.task.task_index, ctx.step) not in {(self.task, s) for s in self.steps}:
            return {"boom": zero}
        if self.grad:  # a finite value (0) whose gradient is inf - inf = NaN
            total = outputs.logits.sum()
            return {"boom": (total - total).sqrt()}
        return {"boom": zero * float("nan")}


def run(model_dir: Path, out: Path, method: Method | None, **train: Any) -> dict[str, Any]:
    raw = tiny_run_config(model_dir, train={**TRAIN, **train}, probes=[])
    cfg = validate_config(raw)
    return Runner(cfg, out, Console(quiet=True), progress=False, method=method).run().to_json()


def test_nan_stops_records_the_event_and_keeps_the_last_good_checkpoint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    method = NaNAt(task=2, steps={1})
    with pytest.raises(TrainingError, match=r"^task 'cipher' step 1: loss term 'boom' is nan$"):
        run(tiny_model_dir, tmp_path, method)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["completed_tasks"] == 1 and results["status"] == "running"
    assert results["events"] == [
        {
            "type": "nonfinite",
            "action": "stop",
            "task": "cipher",
            "step": 1,
            "term": "boom",
            "value": "nan",
        }
    ]
    assert method.digests, "task 1's checkpoint existed when task 2 started"
    for path, digest in method.digests.items():
        assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest, path
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["task-01-reverse"]
    assert not list(tmp_path.rglob(".tmp*"))
    # The run resumes from the last good checkpoint and keeps the event on record.
    resumed = run(tiny_model_dir, tmp_path, NaNAt(task=0, steps=set()))
    assert resumed["status"] == "complete" and resumed["events"] == results["events"]


def test_nan_gradient_stops_with_task_and_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TrainingError, match=r"^task 'reverse' step 2: non-finite gradient$"):
        run(tiny_model_dir, tmp_path, NaNAt(task=1, steps={2}, grad=True))
    (event,) = json.loads((tmp_path / "results.json").read_text())["events"]
    assert event["term"] == "grad_norm" and event["step"] == 2 and event["action"] == "stop"


def test_skip_drops_the_updates_and_counts_them(tiny_model_dir: Path, tmp_path: Path) -> None:
    with warnings.catch_warnings():  # a skipped first step is no scheduler misuse
        warnings.filterwarnings("error", "Detected call of `lr_scheduler.step", UserWarning)
        results = run(
            tiny_model_dir, tmp_path, NaNAt(task=1, steps={0, 2}), on_nonfinite="skip", steps=4
        )
    assert results["status"] == "complete"
    first, second = results["per_task"]
    assert first["skipped_steps"] == 2 and "skipped_steps" not in second
    assert results["events"] == [
        {
            "type": "nonfinite",
            "action": "skip",
            "task": "reverse",
            "count": 2,
            "steps": [0, 2],
            "terms": {"boom": 2},
        }
    ]
    assert all(v == v for v in first["loss_terms"].values()), "skipped steps are not averaged"


@pytest.mark.parametrize("grad", [False, True])
def test_skipping_every_step_leaves_the_weights_untouched(
    tiny_model_dir: Path, tmp_path: Path, grad: bool
) -> None:
    results = run(
        tiny_model_dir,
        tmp_path,
        NaNAt(task=1, steps={0, 1, 2}, grad=grad),
        on_nonfinite="skip",
    )
    assert results["per_task"][0]["skipped_steps"] == 3
    base = _weights(tiny_model_dir / "model.safetensors")
    after = _weights(tmp_path / "checkpoints/task-01-reverse/model.safetensors")
    assert base.keys() == after.keys()
    assert all(torch.equal(after[k], base[k]) for k in base), "a skipped step changed a weight"
    trained = _weights(tmp_path / "checkpoints/task-02-cipher/model.safetensors")
    assert any(not torch.equal(trained[k], base[k]) for k in base), "task 2 trains as usual"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors, with the tied embedding / LM head present under both names."""
    tensors = load_file(str(path))
    tied = ("model.embed_tokens.weight", "lm_head.weight")
    for a, b in (tied, tied[::-1]):
        if a in tensors and b not in tensors:
            tensors[b] = tensors[a]
    return tensors


def test_on_nonfinite_is_validated(tiny_model_dir: Path) -> None:
    from forgetless.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.on_nonfinite"):
        validate_config(tiny_run_config(tiny_model_dir, train={"on_nonfinite": "ignore"}))
