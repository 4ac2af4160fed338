"""Layer freezing: only the chosen decoder layers move, for full fine-tuning and for LoRA."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from safetensors.torch import load_file
from torch import nn

from forgetless.config.loading import validate_config
from forgetless.errors import ConfigError
from forgetless.methods.freeze import Freeze, FreezeConfig, layer_id, trainable_layer_ids
from forgetless.training.runner import Runner


def test_trainable_layer_ids() -> None:
    assert trainable_layer_ids(4, 1, None) == {3}
    assert trainable_layer_ids(4, 4, None) == {0, 1, 2, 3}
    assert trainable_layer_ids(4, 1, [0, 2]) == {0, 2}  # explicit layers win over top
    with pytest.raises(ValueError, match=r"\[4\] do not exist"):
        trainable_layer_ids(4, 1, [1, 4])
    with pytest.raises(ValueError, match="train_top_layers=5"):
        trainable_layer_ids(4, 5, None)


def test_layer_id_from_parameter_names() -> None:
    assert layer_id("model.layers.12.mlp.up_proj.weight") == 12
    assert layer_id("base_model.model.model.layers.0.self_attn.q_proj.lora_A.task_1.weight") == 0
    assert layer_id("model.embed_tokens.weight") is None
    assert layer_id("model.norm.weight") is None


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
        self.head = nn.Linear(2, 2)


def test_missing_layer_is_a_one_line_error() -> None:
    method = Freeze(FreezeConfig.model_validate({"layers": [2]}))
    with pytest.raises(ConfigError, match=r"method 'freeze': layer\(s\) \[2\] do not exist"):
        method.on_task_start(SimpleNamespace(model=TwoLayers()))  # type: ignore[arg-type]


def test_task_start_freezes_everything_outside(tmp_path: Path) -> None:
    model = TwoLayers()
    Freeze(FreezeConfig.model_validate({"layers": [0], "freeze_embeddings": False})).on_task_start(
        SimpleNamespace(model=model)  # type: ignore[arg-type]
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"layers.0.weight", "layers.0.bias", "head.weight", "head.bias"}


def _run(model_dir: Path, out: Path, method: dict[str, Any], **overrides: Any) -> Path:
    raw = tiny_run_config(model_dir, method={"name": "freeze", **method}, probes=[], **overrides)
    Runner(validate_config(raw), out, Console(quiet=True), progress=False).run()
    return next((out / "checkpoints").glob("task-02-*"))


def _changed(base: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Which weights moved; the tied embedding is stored as ``lm_head.weight`` in checkpoints."""
    if "lm_head.weight" in trained and "lm_head.weight" not in base:
        trained["model.embed_tokens.weight"] = trained.pop("lm_head.weight")
    assert set(base) == set(trained)
    return {k: not torch.equal(base[k], trained[k]) for k in base}


def test_full_finetuning_moves_only_the_top_layer(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    ckpt = _run(tiny_model_dir, tmp_path, {"train_top_layers": 1})
    changed = _changed(base, load_file(str(ckpt / "model.safetensors")))
    inside = {k for k in changed if ".layers.1." in k}
    assert inside and all(changed[k] for k in inside)  # every weight of layer 1 trained
    assert not any(changed[k] for k in changed.keys() - inside)  # the rest is bit-identical


def test_explicit_layers_and_trainable_embeddings(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    ckpt = _run(tiny_model_dir, tmp_path, {"layers": [0], "freeze_embeddings": False})
    changed = _changed(base, load_file(str(ckpt / "model.safetensors")))
    assert not any(v for k, v in changed.items() if ".layers.1." in k)
    assert all(v for k, v in changed.items() if ".layers.0." in k)
    assert changed["model.embed_tokens.weight"] and changed["model.norm.weight"]


@pytest.mark.parametrize("regime", ["carry", "per_task"])
def test_lora_trains_only_adapters_in_chosen_layers(
    regime: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    finetune = {"mode": "lora", "lora": {"r": 2, "regime": regime}}
    ckpt = _run(tiny_model_dir, tmp_path, {"layers": [0]}, finetune=finetune)
    for file in (ckpt / "adapters").rglob("adapter_model.safetensors"):
        state = load_file(str(file))
        b_inside = [v for k, v in state.items() if "lora_B" in k and ".layers.0." in k]
        b_outside = [v for k, v in state.items() if "lora_B" in k and ".layers.1." in k]
        assert b_inside and b_outside
        assert all(v.abs().sum() > 0 for v in b_inside), file  # B starts at zero: it trained
        assert all(torch.count_nonzero(v) == 0 for v in b_outside), file  # never updated
