"""O-LoRA: the orthogonality loss, and new adapters that end orthogonal to the old ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from safetensors.torch import load_file

from forgetless.config.loading import validate_config
from forgetless.errors import ConfigError
from forgetless.methods.o_lora import l2_loss, orthogonality_loss
from forgetless.training.runner import Runner

PER_TASK = {"mode": "lora", "lora": {"r": 2, "regime": "per_task"}}


def test_loss_is_zero_for_orthogonal_subspaces() -> None:
    eye = torch.eye(4)
    new = [eye[:2], eye[:1]]  # two layers: rows span e0,e1 and e0
    past = [[eye[2:], eye[1:3]], [eye[3:], eye[3:]]]  # two past tasks, disjoint rows
    assert orthogonality_loss(new, past).item() == 0.0
    assert orthogonality_loss(new, []).item() == 0.0  # the first task has nothing to avoid


def test_loss_is_the_sum_of_squared_overlaps() -> None:
    a_new = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    a_old = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    # a_new @ a_old.T = [[1, 0], [0, 2]] -> 1 + 4, counted once per past task
    assert orthogonality_loss([a_new], [[a_old]]).item() == pytest.approx(5.0)
    assert orthogonality_loss([a_new], [[a_old], [a_old]]).item() == pytest.approx(10.0)
    assert orthogonality_loss([a_new], [[-a_old]]).item() > 0  # sign does not cancel
    with pytest.raises(ValueError):
        orthogonality_loss([a_new], [[a_old, a_old]])


def test_l2_loss_and_gradients_reach_only_the_new_adapter() -> None:
    a_new = torch.tensor([[3.0, 4.0]], requires_grad=True)
    a_old = torch.tensor([[1.0, 0.0]])
    assert l2_loss([a_new, torch.ones(2)]).item() == pytest.approx(27.0)
    orthogonality_loss([a_new], [[a_old]]).backward()
    assert a_new.grad is not None and a_new.grad[0, 0].item() == pytest.approx(6.0)


def _overlap(out: Path) -> float:
    """Mean over LoRA layers of ‖A_2 A_1ᵀ‖_F / (‖A_1‖_F ‖A_2‖_F) after the second task."""
    folder = next((out / "checkpoints").glob("task-02-*")) / "adapters"
    a1 = load_file(str(folder / "task_1" / "adapter_model.safetensors"))
    a2 = load_file(str(folder / "task_2" / "adapter_model.safetensors"))
    keys = [k for k in a1 if "lora_A" in k]
    assert keys and set(keys) <= set(a2)
    ratios = [float((a2[k] @ a1[k].T).norm() / (a1[k].norm() * a2[k].norm())) for k in keys]
    return sum(ratios) / len(ratios)


def _run(model_dir: Path, out: Path, lambda_orth: float) -> dict[str, Any]:
    raw = tiny_run_config(
        model_dir,
        method={"name": "o_lora", "lambda_orth": lambda_orth},
        finetune=PER_TASK,
        train={"steps": 20, "batch_size": 8, "lr": 1e-2, "max_length": 32},
        probes=[],
    )
    return Runner(validate_config(raw), out, Console(quiet=True), progress=False).run().to_json()


def test_new_adapter_ends_orthogonal_to_the_old(tiny_model_dir: Path, tmp_path: Path) -> None:
    free = _run(tiny_model_dir, tmp_path / "free", 0.0)
    ortho = _run(tiny_model_dir, tmp_path / "ortho", 100.0)
    first, second = ortho["per_task"]
    assert first["loss_terms"]["orthogonality"] == 0.0  # nothing to be orthogonal to yet
    assert second["loss_terms"]["orthogonality"] > 0 and "l2" in second["loss_terms"]
    without, with_ = _overlap(tmp_path / "free"), _overlap(tmp_path / "ortho")
    assert free["per_task"][1]["loss_terms"]["orthogonality"] == 0.0
    assert with_ < 0.2 * without and with_ < 0.03, (with_, without)


def test_config_rejects_full_finetuning(tiny_model_dir: Path) -> None:
    for finetune in [{"mode": "full"}, {"mode": "lora", "lora": {"regime": "carry"}}]:
        raw = tiny_run_config(tiny_model_dir, method={"name": "o_lora"}, finetune=finetune)
        with pytest.raises(ConfigError) as err:
            validate_config(raw)
        message = str(err.value)
        assert "\n" not in message and "'o_lora'" in message and "per_task" in message, message
