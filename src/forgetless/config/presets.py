"""Built-in presets: the tiny demo on the built-in suite, from the shipped tiny base."""

from __future__ import annotations

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
        "train": {"steps": 200, "batch_size": 32, "lr": 3e-4},
        "eval": {"n_eval": 100},
        "tasks": list(DEMO_SEQUENCE),
        "probes": list(DEMO_PROBES),
        "method": {"name": "seq_ft"},
    }


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "tiny": demo_config_dict,
}
