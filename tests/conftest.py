"""Tiny offline fixtures: a char-level tokenizer and 2-layer Qwen2/Llama models saved on disk."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at test time
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from forgetless.contract.method import Capability, StepContext
from forgetless.methods.seq_ft import SeqFT, SeqFTConfig
from forgetless.testing import TINY, save_tiny, tiny_run_config, write_jsonl

__all__ = ["TINY", "moved_lora", "save_tiny", "tiny_run_config", "write_jsonl"]


def moved_lora(model_dir: Path, **lora: Any) -> Any:
    """The saved tiny model under LoRA adapters (PEFT ``LoraConfig`` fields; r 2, q and v by
    default) whose B factors are moved off zero: a model that is no longer the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    settings = {"r": 2, "target_modules": ["q_proj", "v_proj"], **lora}
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **settings))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param), alpha=0.5)
    return peft_model.train()


@pytest.fixture(autouse=True)
def reproducibility() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_llama_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama-chat"), arch="llama", chat=True)


TIERS = ("unit", "methods", "integration", "slow")
"""Each test's folder is its marker: ``pytest -m unit`` runs the pure-function tests alone."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in TIERS:
            item.add_marker(getattr(pytest.mark, folder))


class CrashAt(SeqFT):
    """seq_ft that dies at a given task and step, as a killed process would."""

    capabilities = frozenset({Capability.BATCH_TRANSFORM})

    def __init__(self, task: int, step: int) -> None:
        super().__init__(SeqFTConfig())
        self.where = (task, step)

    def transform_batch(self, features: list[Any], ctx: StepContext) -> list[Any]:
        if (ctx.task.task_index, ctx.step) == self.where:
            raise KeyboardInterrupt("simulated crash")
        return features
