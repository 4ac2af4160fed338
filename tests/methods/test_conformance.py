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
from forgetless.training.pretrain import SHIPPED_BASE
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


BETWEEN_TASKS_STATELESS = {
    "sdft": "test_sdft.py::test_a_run_cut_mid_task_resumes_the_ema_teacher_from_the_step_checkpoint"
}
"""Methods whose state lives within a task (saved in step checkpoints, where the named test
round-trips it): nothing is left to save after a task."""


def _bed(name: str) -> dict[str, Any]:
    """What the run trains on, where a method needs more than the default to act: the gate
    maps only the answers the model gets right, and the random tiny model gets none."""
    if name == "attribution_gate":
        base = {"name_or_path": str(SHIPPED_BASE)}
        return {"model": base, "tasks": ["copy", "reverse"], "probes": ["upper"]}
    return {}


def _run(
    model_dir: Path, out: Path, name: str, finetune: str, bed: str | None = None
) -> dict[str, Any]:
    method, own = _case(name)
    raw = tiny_run_config(
        model_dir,
        method=method,
        finetune={**own, "mode": finetune, "lora": {"r": 2, **own.get("lora", {})}},
        train={"steps": 3, "batch_size": 8, "lr": 1e-3, "max_length": 32},
        **_bed(bed or name),
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
    _saved_state_round_trips(name, _last_checkpoint(tmp_path / "a"))
    if name != "seq_ft":
        control = _run(tiny_model_dir, tmp_path / "seq_ft", "seq_ft", finetune, bed=name)
        assert control["status"] == "complete"
        assert _differs(_last_checkpoint(tmp_path / "a"), _last_checkpoint(tmp_path / "seq_ft")), (
            f"{name} trained exactly as seq_ft does: its hooks changed nothing"
        )


@pytest.mark.parametrize("name", BUILTIN)
def test_method_trains_with_gradient_checkpointing(
    name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every method's hooks and extra forward passes (anchors, references, Fisher and
    relevance passes) work with the decoder layers checkpointed: the run trains as it does
    without checkpointing, term by term and weight by weight."""
    method, own = _case(name)
    finetune = "lora" if registered_methods()[name].lora_regimes else "full"

    def run(checkpointing: bool) -> dict[str, Any]:
        raw = tiny_run_config(
            model_dir=tiny_model_dir,
            method=method,
            finetune={**own, "mode": finetune, "lora": {"r": 2, **own.get("lora", {})}},
            train={
                "steps": 2,
                "batch_size": 4,
                "max_length": 32,
                "gradient_checkpointing": checkpointing,
            },
            eval={"n_eval": 4, "n_train": 16, "batch_size": 8, "kl_examples": 2},
        )
        out = tmp_path / str(checkpointing)
        return (
            Runner(validate_config(raw), out, Console(quiet=True), progress=False).run().to_json()
        )

    checkpointed, plain = run(True), run(False)
    assert (
        checkpointed["status"] == "complete" and checkpointed["runtime"]["gradient_checkpointing"]
    )
    for ours, theirs in zip(checkpointed["per_task"], plain["per_task"], strict=True):
        assert ours["loss_terms"].keys() == theirs["loss_terms"].keys()
        for term, value in ours["loss_terms"].items():
            assert value == pytest.approx(theirs["loss_terms"][term], rel=1e-4, abs=1e-6), term
    left = _weights(_last_checkpoint(tmp_path / "True"))
    right = _weights(_last_checkpoint(tmp_path / "False"))
    assert left.keys() == right.keys()
    for key, tensor in left.items():
        torch.testing.assert_close(tensor, right[key], rtol=1e-4, atol=1e-5, msg=key)


def _last_checkpoint(out: Path) -> Path:
    return sorted(p for p in (out / "checkpoints").iterdir() if p.name.startswith("task-"))[-1]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.rglob("*.safetensors"))
    return {f"{f.relative_to(folder)}:{k}": v for f in files for k, v in load_file(str(f)).items()}


def _differs(a: Path, b: Path) -> bool:
    left, right = _weights(a), _weights(b)
    return left.keys() != right.keys() or any(not torch.equal(left[k], right[k]) for k in left)


def _holds_something(state: Any) -> bool:
    if isinstance(state, torch.Tensor):
        return state.numel() > 0
    if isinstance(state, dict):
        return any(_holds_something(v) for v in state.values())
    if isinstance(state, list | tuple):
        return any(_holds_something(v) for v in state)
    return state is not None


def _saved_state_round_trips(name: str, checkpoint: Path) -> None:
    """The state a run saved after its last task loads into a fresh method and comes back out
    the same; a method that declares state has saved some."""
    cls = registered_methods()[name]
    if Capability.STATE not in cls.capabilities:
        return
    saved = load_method_state(checkpoint)
    if name in BETWEEN_TASKS_STATELESS:
        assert not _holds_something(saved), f"{name} saved state between tasks"
        return
    assert _holds_something(saved), f"{name} declares state but saved none after two tasks"
    fresh = create_method(cls.config_cls.model_validate(_case(name)[0]))
    fresh.load_state_dict(saved)
    assert json.dumps(fresh.state_dict(), default=_exact, sort_keys=True) == json.dumps(
        saved, default=_exact, sort_keys=True
    )


def _exact(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return [str(value.dtype), value.flatten().tolist()]
    return str(value)


def _same_checkpoint(a: Path, b: Path) -> None:
    for file in (a / "checkpoints").rglob("*.safetensors"):
        left, right = load_file(str(file)), load_file(str(b / file.relative_to(a)))
        assert left.keys() == right.keys()
        assert all(torch.equal(left[k], right[k]) for k in left), file


@pytest.mark.parametrize("name", BUILTIN)
def test_a_fresh_methods_state_round_trips(name: str, tmp_path: Path) -> None:
    """Before any task: what a method saves loads back (the trained state is checked after a
    run, in test_method_contract)."""
    method = create_method(registered_methods()[name].config_cls.model_validate(_case(name)[0]))
    state = method.state_dict()
    save_method_state(tmp_path, state)
    restored = load_method_state(tmp_path)
    assert json.dumps(restored, default=_exact, sort_keys=True) == json.dumps(
        state, default=_exact, sort_keys=True
    )
    method.load_state_dict(restored)
