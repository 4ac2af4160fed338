"""Safetensors checkpoints read lazily, tensor by tensor, and PEFT adapters as factored updates."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from forgetless.core.lowrank import LowRank, lora_scale, lora_update

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
TIED = {"lm_head.weight": "model.embed_tokens.weight"}
"""A tied LM head is saved as the embedding."""


class TensorFiles:
    """Lazy, per-key reads from one or several safetensors files."""

    def __init__(self, files: list[Path]) -> None:
        self.where: dict[str, Path] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    self.where[key] = path

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, key: str) -> torch.Tensor:
        with safe_open(str(self.where[key]), framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(key)
        return tensor


def adapter_terms(folder: Path) -> dict[str, LowRank]:
    """``module → s·B·A`` for one adapter folder in PEFT's layout."""
    cfg = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    tensors = TensorFiles([folder / ADAPTER_FILE])
    out: dict[str, LowRank] = {}
    for key in tensors.names():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        r = int(cfg["rank_pattern"].get(module, cfg["r"])) if cfg.get("rank_pattern") else cfg["r"]
        alpha = float(cfg.get("lora_alpha", r))
        scale = lora_scale(alpha, int(r), bool(cfg.get("use_rslora", False)))
        out[module] = lora_update(
            tensors.get(key), tensors.get(key.replace("lora_A", "lora_B")), scale
        )
    return out
