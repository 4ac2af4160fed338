"""Tiny offline fixtures: a char-level tokenizer and 2-layer Qwen2/Llama models saved on disk."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at test time
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from forgetless.config.schema import TinyModelConfig
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64
)


@pytest.fixture(autouse=True)
def reproducibility() -> None:
    random.seed(0)
    torch.manual_seed(0)


def save_tiny(folder: Path, arch: str = "qwen2", chat: bool = False) -> Path:
    tokenizer = build_char_tokenizer()
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    model = build_tiny_model(
        TINY.model_copy(update={"arch": arch}), vocab_size=len(tokenizer), seed=0
    )
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_llama_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama-chat"), arch="llama", chat=True)


def tiny_run_config(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A fast two-task run on the tiny model with one probe."""
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


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path
