"""What a run checks and says once its model and tasks are loaded, before anything is trained:
the device, dtype, autocast, attention and checkpointing in use, ``train.max_length`` against
the model and the data, a learning rate left at the tiny model's default on a real model, and
chat turns a template leaves out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from forgetless.config.schema import RunConfig
from forgetless.core.machine import load_average
from forgetless.models.device import describe
from forgetless.models.loading import attention_in_use, attention_note, model_positions
from forgetless.tasks.base import Task
from forgetless.tasks.chat_turns import dropped_turns_warning
from forgetless.tasks.lengths import fit_max_length

Say = Callable[[str], None]

TINY_DEFAULT_LR = 1e-3
TINY_DEFAULT_BATCH = 32
"""``train.lr`` and ``train.batch_size``'s defaults, sized for the built-in tiny model."""
REAL_MODEL_PARAMETERS = 10_000_000
"""Above this many weights a model is taken for a real one (the tiny base has about 1M)."""
SUGGESTED_LR = {"full": "1e-5 to 2e-5", "lora": "1e-4 to 2e-4"}
"""Common starting learning rates for fine-tuning a pretrained LLM: TRL's ``SFTConfig``
defaults to 2e-5 for full fine-tuning, and TRL's PEFT guide trains LoRA adapters at 2e-4, about
ten times the full rate (Hugging Face TRL documentation, "SFT Trainer" and "PEFT integration";
the LoRA/full ratio also in Schulman et al. 2025, "LoRA Without Regret")."""


def lr_advice(cfg: RunConfig, parameters: int) -> str | None:
    """A warning when a real model would train at the tiny model's learning rate and batch."""
    train = cfg.train
    defaults = train.lr == TINY_DEFAULT_LR and train.batch_size == TINY_DEFAULT_BATCH
    at_default = any(t.train.lr is None for t in cfg.tasks)
    if not defaults or not at_default or parameters <= REAL_MODEL_PARAMETERS:
        return None
    mode = cfg.finetune.mode
    what = "full fine-tuning" if mode == "full" else "LoRA"
    return (
        f"warning: train.lr={train.lr:g} and train.batch_size={train.batch_size} are the tiny "
        f"model's defaults; a model of {parameters / 1e6:.0f}M parameters under {what} usually "
        f"trains at lr {SUGGESTED_LR[mode]}: set train.lr (and train.batch_size, with "
        "train.grad_accum, to what memory allows)"
    )


def _weights_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def runtime(cfg: RunConfig, model: nn.Module, device: torch.device) -> dict[str, Any]:
    """How the run computes, for ``results.json``'s ``runtime``."""
    return {
        "device": str(device),
        "dtype": str(_weights_dtype(model)).removeprefix("torch."),
        "autocast": cfg.train.autocast,
        "attn_implementation": attention_in_use(model),
        "gradient_checkpointing": cfg.train.gradient_checkpointing,
        "threads": torch.get_num_threads(),
        "load_at_start": load_average(),
    }


def runtime_line(record: dict[str, Any]) -> str:
    """The start-up line after the device's: autocast, attention and checkpointing."""
    scaled = " (loss scaled)" if record["autocast"] == "fp16" else ""
    checkpointing = "on" if record["gradient_checkpointing"] else "off"
    return (
        f"autocast: {record['autocast']}{scaled}, attention: {record['attn_implementation']}, "
        f"gradient checkpointing: {checkpointing}"
    )


def start_up(
    cfg: RunConfig,
    model: nn.Module,
    tokenizer: Any,
    tasks: Sequence[Task],
    probes: Sequence[Task],
    device: torch.device,
    say: Say,
) -> RunConfig:
    """Check and say what the run will use; return ``cfg`` with ``train.max_length`` set."""
    say(describe(device, cfg.device, _weights_dtype(model), cfg.train.autocast))
    say(runtime_line(runtime(cfg, model, device)))
    note = attention_note(cfg.model, model)
    if note is not None:
        say(note)
    fitted = fit_max_length(
        cfg.train.max_length, tokenizer, [*tasks, *probes], model_positions(model)
    )
    if fitted.chosen is not None:
        say(fitted.chosen)
    if cfg.model.name_or_path is not None:
        advice = lr_advice(cfg, sum(p.numel() for p in model.parameters()))
        if advice is not None:
            say(advice)
    for task in [*tasks, *probes]:
        warning = dropped_turns_warning(task, tokenizer)
        if warning is not None:
            say(warning)
    train = cfg.train.model_copy(update={"max_length": fitted.tokens})
    return cfg.model_copy(update={"train": train})
