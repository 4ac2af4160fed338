"""Built-in presets: the tiny demo from the shipped tiny base, and the real-model track.

A preset is either the whole config (no file given) or the layer under a user's file (its
``preset:`` key, or ``--preset``): the file's own keys win, mappings merged key by key."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from forgetless.errors import ConfigError

DEMO_SEQUENCE = ["reverse", "cipher", "bracket"]
DEMO_PROBES = ["copy", "upper", "facts", "add"]
DEMO_BENCH_METHODS = [
    *("seq_ft", "replay", "ewc", "kl_sft"),
    *("dft", "asft", "eaft", "sdft", "block_expansion"),
]
"""The bench demo's methods (``forgetless bench`` without variants): the baseline, one of each
family, and the remedies users have elsewhere (those registered run)."""

SMOLLM2_SEQUENCE = ["it-json", "it-wordrev", "it-topic", "it-robot"]
"""Four skills each learnt alone at the budget (studies/results/real_tasks.json), chosen on
the tuning seed 100 (docs/real-track.md); the persona task last."""
SMOLLM2_TASK_LR = {"it-robot": 2e-3}
"""Per-task learning rates: the persona task, the one that moves the multiple-choice probe, at
2e-3 (chosen on the tuning seed 100 by a rule fixed before the runs, docs/real-track.md)."""
SMOLLM2_LORA_LAYERS = list(range(22, 30))
"""The top 8 of SmolLM2-135M's 30 layers: the backward pass stops below them."""


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


def smollm2_tasks() -> list[Any]:
    """The preset's sequence, a task with its own learning rate written out in full."""
    return [
        {"builtin": name, "train": {"lr": SMOLLM2_TASK_LR[name]}}
        if name in SMOLLM2_TASK_LR
        else name
        for name in SMOLLM2_SEQUENCE
    ]


def smollm2_config_dict() -> dict[str, Any]:
    """SmolLM2-135M-Instruct with LoRA on its top layers, four instruct tasks, and the general
    probes: the question set (multiple choice and short answer), chat-format discipline and the
    held-out prose. Sized for a seq_ft run within 20 minutes on two CPU cores
    (docs/performance.md)."""
    return {
        "seed": 0,
        "model": {"name_or_path": "smollm2-135m-instruct"},
        "finetune": {
            "mode": "lora",
            "lora": {"r": 8, "alpha": 16, "layers": list(SMOLLM2_LORA_LAYERS), "regime": "carry"},
        },
        "train": {
            "steps": 100,
            "batch_size": 8,
            "lr": 5e-4,
            "max_length": 96,
        },
        "eval": {
            "n_eval": 48,
            "n_train": 1000,
            "between": 16,
            "batch_size": 32,
            "kl_examples": 16,
            "loglik_examples": 16,
            "prose": True,
            "prose_paragraphs": 32,
            "cache_base_row": True,
        },
        "tasks": smollm2_tasks(),
        "probes": [
            {"builtin": "gk-mc", "n_eval": 320},
            {"builtin": "gk-short", "n_eval": 96},
            {"builtin": "chat-format", "n_eval": 32},
        ],
        "method": {"name": "seq_ft"},
    }


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "tiny": demo_config_dict,
    "smollm2": smollm2_config_dict,
}


def preset_config(name: object, where: str = "") -> dict[str, Any]:
    """The preset's config data; an unknown name is one line with the known ones and the
    closest match (``where`` names the place, e.g. ``run.yaml: preset``)."""
    if not isinstance(name, str) or name not in PRESETS:
        close = difflib.get_close_matches(str(name), PRESETS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        place = f"{where}: " if where else ""
        raise ConfigError(f"{place}unknown preset {name!r}; known: {', '.join(PRESETS)}{hint}")
    return PRESETS[name]()


def layered(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``under``: mappings merge key by key, anything else (a list, a
    value, null) in ``over`` replaces what is under it."""
    out = dict(under)
    for key, value in over.items():
        below = out.get(key)
        if isinstance(below, dict) and isinstance(value, dict):
            value = layered(below, value)
        out[key] = value
    return out


def supplied_keys(preset: dict[str, Any], own: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys the preset sets that ``own`` leaves unset (a list counts as one key)."""
    keys = []
    for key, value in preset.items():
        path = f"{prefix}{key}"
        if key not in own:
            keys += supplied_keys(value, {}, f"{path}.") if _nonempty_map(value) else [path]
        elif _nonempty_map(value) and isinstance(own[key], dict):
            keys += supplied_keys(value, own[key], f"{path}.")
    return keys


def _nonempty_map(value: Any) -> bool:
    return isinstance(value, dict) and bool(value)
