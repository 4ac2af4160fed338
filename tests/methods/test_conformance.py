"""Every registered method through the same contract on a tiny model (PEFT-style matrix)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from safetensors.torch import load_file

from forgetless.config.loading import validate_config
from forgetless.contract import Capability, create_method, registered_methods
from forgetless.core.storage import load_method_state, save_method_state
from forgetless.testing import smoke_method
from forgetless.training.runner import Runner

BUILTIN = sorted(
    n
    for n, c in registered_methods().items()
    if c.__module__.startswith(("forgetless.methods.", "forgetless.experimental.methods."))
)


def test_every_builtin_smoke_config_validates() -> None:
    for name in BUILTIN:
        method, finetune = smoke_method(name)
        validate_config({"tasks": ["reverse"], "method": method, "finetune": finetune})


def _case(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A method's smoke config and the fine-tuning it needs, from the registry."""
    return smoke_method(name)


def _run(model_dir: Path, out: Path, name: str, finetune: str) -> dict[str, Any]:
    method, own = _case(name)
    raw = tiny_run_config(
        model_dir,
        method=method,
        finetune={**own, "mode": finetune, "lora": {"r": 2, **own.get("lora", {})}},
        train={"steps": 3, "batch_size": 8, "lr": 1e-3, "max_length": 32},
    )
    cfg = validate_config(raw)
    return Runner(cfg, out, Console(quiet=True), progress=False).run().to_json()


@pytest.mark.parametrize("finetune", ["full", "lora"])
@pytest.mark.parametrize("name", BUILTIN)
def test_method_contract(name: str, finetune: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    cls = registered_methods()[name]
    if finetune == "full" and cls.lora_regimes:
        pytest.skip(f"{name} needs LoRA")
    if finetune == "lora" and cls.full_only:
        pytest.skip(f"{name} refuses LoRA")
    assert cls.__doc__, f"{name} needs a docstring"
    for field_name, field in cls.config_cls.model_fields.items():
        assert field.description or field_name == "name", f"{name}.{field_name} needs a description"
    first = _run(tiny_model_dir, tmp_path / "a", name, finetune)
    assert first["status"] == "complete"
    for stats in first["per_task"]:
        assert all(v == v and abs(v) != float("inf") for v in stats["loss_terms"].values())
    second = _run(tiny_model_dir, tmp_path / "b", name, finetune)
    assert first["accuracy_matrix"] == second["accuracy_matrix"], "deterministic under a seed"
    assert first["kl_drift"] == second["kl_drift"]
    _same_checkpoint(tmp_path / "a", tmp_path / "b")


@pytest.mark.parametrize("name", BUILTIN)
def test_method_trains_with_gradient_checkpointing(
    name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every method's hooks and extra forward passes (anchors, references, Fisher and
    relevance passes) still work with the decoder layers checkpointed."""
    method, own = _case(name)
    finetune = "lora" if registered_methods()[name].lora_regimes else "full"
    raw = tiny_run_config(
        model_dir=tiny_model_dir,
        method=method,
        finetune={**own, "mode": finetune, "lora": {"r": 2, **own.get("lora", {})}},
        train={"steps": 2, "batch_size": 4, "max_length": 32, "gradient_checkpointing": True},
        eval={"n_eval": 4, "n_train": 16, "batch_size": 8, "kl_examples": 2},
    )
    out = Runner(validate_config(raw), tmp_path, Console(quiet=True), progress=False).run()
    result = out.to_json()
    assert result["status"] == "complete" and result["runtime"]["gradient_checkpointing"]
    for stats in result["per_task"]:
        assert all(v == v and abs(v) != float("inf") for v in stats["loss_terms"].values())


def _same_checkpoint(a: Path, b: Path) -> None:
    for file in (a / "checkpoints").rglob("*.safetensors"):
        left, right = load_file(str(file)), load_file(str(b / file.relative_to(a)))
        assert left.keys() == right.keys()
        assert all(torch.equal(left[k], right[k]) for k in left), file


@pytest.mark.parametrize("name", BUILTIN)
def test_state_dict_round_trip(name: str, tmp_path: Path) -> None:
    method = create_method(registered_methods()[name].config_cls.model_validate(_case(name)[0]))
    state = method.state_dict()
    save_method_state(tmp_path, state)
    restored = load_method_state(tmp_path)
    assert json.dumps(restored, default=str, sort_keys=True) == json.dumps(
        state, default=str, sort_keys=True
    )
    method.load_state_dict(restored)
    assert Capability.STATE in method.capabilities or state == {}
