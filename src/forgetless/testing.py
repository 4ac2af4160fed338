"""The tiny set-up that tests and benchmarks build on: a char-tokenizer model saved like a hub
model, a fast run config on it, a method's smoke config from the registry, and a task context.

Nothing here downloads; everything is built from a config under a seed, in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from forgetless.config.schema import TinyModelConfig
from forgetless.contract.method import RunInfo, TaskContext, method_class
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import encode_example

TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64
)
"""A 2-layer model small enough for a unit test."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def save_tiny(folder: Path, arch: str = "qwen2", chat: bool = False) -> Path:
    """The tiny model and its tokenizer saved in ``save_pretrained`` layout (loads as a hub id)."""
    tokenizer = build_char_tokenizer()
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    model = build_tiny_model(
        TINY.model_copy(update={"arch": arch}), vocab_size=len(tokenizer), seed=0
    )
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def tiny_run_config(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A fast two-task run on a saved tiny model with one probe (top-level keys overridable)."""
    config: dict[str, Any] = {
        "seed": 0,
        "model": {"name_or_path": str(model_dir)},
        "train": {"steps": 4, "batch_size": 8, "lr": 1e-3, "max_length": 32},
        "eval": {"n_eval": 8, "n_train": 32, "batch_size": 8, "kl_examples": 4},
        "tasks": ["reverse", "cipher"],
        "probes": ["copy"],
    }
    config.update(overrides)
    return config


def smoke_method(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A method's smoke config (``Method.smoke``) and the fine-tuning it needs (its first LoRA
    regime, when it declares any)."""
    cls = method_class(name)
    regimes = cls.lora_regimes
    finetune = {"mode": "lora", "lora": {"regime": regimes[0]}} if regimes else {}
    return {"name": name, **cls.smoke}, finetune


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def task_context(
    model: torch.nn.Module,
    tasks: list[str],
    index: int = 1,
    n_train: int = 16,
    out_dir: Path = Path("."),
    max_length: int = 64,
    finetune_mode: str = "full",
    lora_regime: str | None = None,
) -> TaskContext:
    """The context of task ``index`` (1-based) of the built-in ``tasks`` on ``model``, with the
    char tokenizer and the first ``n_train`` training examples encoded."""
    tokenizer = build_char_tokenizer()
    sequence = [build_builtin_task(t, n_train=n_train, n_eval=4, seed=0) for t in tasks]
    task = sequence[index - 1]
    info = RunInfo(
        0, out_dir, list(tasks), [], finetune_mode, max_length=max_length, lora_regime=lora_regime
    )
    features = [encode_example(tokenizer, e, max_length) for e in task.train[:n_train]]
    device = next(model.parameters()).device
    return TaskContext(
        info, index, task, model, tokenizer, features, sequence[: index - 1], device, sequence
    )
