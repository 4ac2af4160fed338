"""Built-in presets: the tiny demo and a ~10M-parameter ``small`` scale on the same suite."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

DEMO_SEQUENCE = ["reverse", "cipher", "bracket"]
DEMO_PROBES = ["copy", "upper", "facts", "add"]
DEMO_BENCH_METHODS = ["seq_ft", "replay", "ewc", "kl_sft"]
"""The bench demo's methods: the baseline and one of each family (those registered run)."""


def demo_config_dict() -> dict[str, Any]:
    return {
        "seed": 0,
        "model": {"name_or_path": None},
        "finetune": {"mode": "full"},
        "train": {"steps": 200, "batch_size": 32, "lr": 1e-3},
        "eval": {"n_eval": 100},
        "tasks": list(DEMO_SEQUENCE),
        "probes": list(DEMO_PROBES),
        "method": {"name": "seq_ft"},
    }


SMALL_MODEL = {
    "hidden_size": 256,
    "num_layers": 10,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1024,
    "max_position": 128,
}


def small_config_dict() -> dict[str, Any]:
    """The demo at a second scale: a Qwen2 of ~10M parameters (pretrain it in the background)."""
    config = copy.deepcopy(demo_config_dict())
    config["model"] = {
        "name_or_path": None,
        "tiny": dict(SMALL_MODEL),
        "pretrain": {"steps": 3000, "lr": 1e-3, "batch_size": 32},
    }
    config["train"] = {"steps": 200, "batch_size": 32, "lr": 3e-4}
    return config


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "tiny": demo_config_dict,
    "small": small_config_dict,
}
