"""Pretraining the tiny base model on the base-capability mixture, cached by config hash."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers.utils import logging as hf_logging

from forgetless.config.schema import ModelConfig
from forgetless.contract.method import RunInfo, TaskContext, create_method
from forgetless.contract.plan import TrainPlan
from forgetless.core.ownership import check_output_folder, replace_output
from forgetless.core.paths import cache_root
from forgetless.core.storage import atomic_write_json, cache_fill_lock
from forgetless.engine.progress import Progress
from forgetless.engine.session import TaskSession
from forgetless.eval.generation import evaluate_task
from forgetless.methods.seq_ft import SeqFTConfig
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.tasks.base import Task
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import encode_example

SUITE_VERSION = 2
PRETRAIN_EVAL = 100


def base_fingerprint(cfg: ModelConfig) -> str:
    payload = {
        "tiny": cfg.tiny.model_dump(),
        "pretrain": cfg.pretrain.model_dump(),
        "suite": SUITE_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


SHIPPED_BASE = Path(__file__).resolve().parents[1] / "assets" / "tiny-base"
"""The tiny preset's base, pretrained once and shipped in the package (hash in docs/tiny-suite.md),
so that every machine starts from the same weights and nothing pretrains by default."""


def cached_base_dir(cfg: ModelConfig) -> Path:
    return cache_root() / "base" / base_fingerprint(cfg)


def shipped_base_dir(cfg: ModelConfig) -> Path | None:
    """The shipped base when ``cfg`` is the configuration it was pretrained under."""
    meta = SHIPPED_BASE / "pretrain.json"
    if not meta.is_file():
        return None
    shipped = json.loads(meta.read_text(encoding="utf-8")).get("fingerprint")
    return SHIPPED_BASE if shipped == base_fingerprint(cfg) else None


def ensure_base_model(cfg: ModelConfig, console: Console, progress: bool = True) -> Path:
    """The tiny base for ``cfg``: the shipped one, else the cached one, else pretrained now."""
    shipped = shipped_base_dir(cfg)
    if shipped is not None:
        return shipped
    folder = cached_base_dir(cfg)
    with cache_fill_lock(folder):
        if not (folder / "pretrain.json").is_file():
            console.print(f"[bold]Pretraining the tiny base model[/] (cached in {folder})")
            pretrain_base(cfg, folder, console, progress)
    return folder


def _mixture(cfg: ModelConfig) -> tuple[Task, list[Task]]:
    p = cfg.pretrain
    parts = [
        build_builtin_task(name, n_train=p.n_train, n_eval=PRETRAIN_EVAL, seed=p.seed)
        for name in p.tasks
    ]
    # A skill with a small example space is repeated up to n_train, so each weighs alike.
    train = [task.train[i % len(task.train)] for task in parts for i in range(p.n_train)]
    mix = Task(
        name="base-mixture", train=train, eval=parts[0].eval, description="pretraining mixture"
    )
    return mix, parts


def pretrain_base(
    cfg: ModelConfig, folder: Path, console: Console, progress: bool = True
) -> dict[str, Any]:
    """Build tokenizer and model under the seed, train on the mixture, save atomically."""
    check_output_folder(folder, "pretrain")
    p = cfg.pretrain
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(cfg.tiny, vocab_size=len(tokenizer), seed=p.seed)
    mix, parts = _mixture(cfg)
    features = [encode_example(tokenizer, e, cfg.tiny.max_position) for e in mix.train]
    info = RunInfo(
        seed=p.seed, out_dir=folder, task_names=[mix.name], probe_names=[], finetune_mode="full"
    )
    ctx = TaskContext(info, 1, mix, model, tokenizer, features, [], torch.device("cpu"))
    plan = TrainPlan(
        steps=p.steps,
        batch_size=p.batch_size,
        lr=p.lr,
        seed=p.seed,
        warmup_steps=max(1, p.steps // 20),
        scheduler="cosine",
        weight_decay=0.01,
    )
    with Progress(console, enabled=progress) as bars:
        method = create_method(SeqFTConfig(name="seq_ft"))
        session = TaskSession(method, ctx, tokenizer.pad_token_id, bars, label="pretrain")
        stats = session.train(plan)
    accuracy = {t.name: evaluate_task(model, tokenizer, t, 128).accuracy for t in parts}
    report = {
        "fingerprint": base_fingerprint(cfg),
        "accuracy": accuracy,
        "train": stats.as_dict(),
        "config": {"tiny": cfg.tiny.model_dump(), "pretrain": p.model_dump()},
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    with replace_output(folder, "pretrain") as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        atomic_write_json(tmp / "pretrain.json", report)
    console.print("base accuracy: " + ", ".join(f"{k} {v:.2f}" for k, v in accuracy.items()))
    return report
