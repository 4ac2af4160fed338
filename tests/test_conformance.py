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
from forgetless.training.runner import Runner

# Config per registered method for the contract run; adding a method without a case fails below.
METHOD_CASES: dict[str, dict[str, Any]] = {
    "seq_ft": {"name": "seq_ft"},
    "o_lora": {"name": "o_lora", "_finetune": {"lora": {"regime": "per_task"}}},
    "freeze": {"name": "freeze", "train_top_layers": 1},
    "replay": {"name": "replay", "buffer_size": 16, "ratio": 0.5},
    "mtl": {"name": "mtl"},
    "ewc": {"name": "ewc", "lam": 1e4, "fisher_samples": 8, "fisher_batch_size": 4},
    "kl_sft": {"name": "kl_sft", "beta": 0.1},
    "low_lr": {"name": "low_lr", "lr_scale": 0.1},
    "anchored": {"name": "anchored", "outer_iterations": 2, "inner_steps": 2, "top_k": 8},
    "sae_fd": {"name": "sae_fd", "sae_cache": "run", "sae": {"steps": 20, "n_per_task": 4}},
    "task_arithmetic": {"name": "task_arithmetic", "scaling": 0.5},
    "ties": {"name": "ties", "density": 0.5},
    "opcm": {"name": "opcm", "alpha": 0.5},
    "gcwm": {"name": "gcwm", "rank": 4},
    "attribution_gate": {"name": "attribution_gate", "max_samples": 4},
    "rl": {"name": "rl", "rl_steps": 2, "prompts_per_step": 2, "group_size": 2, "beta": 0.1},
}


def test_matrix_covers_the_registry() -> None:
    builtin = {
        name
        for name, cls in registered_methods().items()
        if cls.__module__.startswith("forgetless.methods.")
    }
    assert set(METHOD_CASES) == builtin


def _case(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A case's method config, and its own finetune settings (``_finetune``, e.g. a regime)."""
    case = dict(METHOD_CASES[name])
    return case, case.pop("_finetune", {})


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
@pytest.mark.parametrize("name", sorted(registered_methods()))
def test_method_contract(name: str, finetune: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    cls = registered_methods()[name]
    if finetune == "full" and cls.lora_regimes:
        pytest.skip(f"{name} needs LoRA")
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


def _same_checkpoint(a: Path, b: Path) -> None:
    for file in (a / "checkpoints").rglob("*.safetensors"):
        left, right = load_file(str(file)), load_file(str(b / file.relative_to(a)))
        assert left.keys() == right.keys()
        assert all(torch.equal(left[k], right[k]) for k in left), file


@pytest.mark.parametrize("name", sorted(registered_methods()))
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
