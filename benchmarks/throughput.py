"""Training throughput of forgetless's step loop against a plain HF ``Trainer`` loop.

Same model (the demo's tiny Qwen2 architecture, randomly initialised), same data, batch and
optimizer (AdamW, constant rate); the two are run alternately (the order reversed every other
repeat) and the ratio of medians reported. Target (issue 11): >= 0.95.
Run: ``python benchmarks/throughput.py [--steps 300] [--repeats 3] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from forgetless.config.schema import ModelConfig
from forgetless.contract.method import RunInfo, TaskContext, create_method
from forgetless.contract.plan import TrainPlan
from forgetless.core.storage import atomic_write_json
from forgetless.engine.loop import StepLoop
from forgetless.methods.seq_ft import SeqFTConfig
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import collate, encode_example

OUT = Path(__file__).parent / "results" / "throughput.json"


def _setup(batch_size: int) -> tuple[Any, Any, list[dict[str, list[int]]]]:
    tokenizer = build_char_tokenizer()
    task = build_builtin_task("reverse", n_train=4000, n_eval=10, seed=0)
    features = [encode_example(tokenizer, e, 64) for e in task.train]
    return tokenizer, task, features


def time_forgetless(steps: int, batch_size: int) -> float:
    tokenizer, task, features = _setup(batch_size)
    model = build_tiny_model(ModelConfig().tiny, len(tokenizer), seed=0)
    info = RunInfo(0, Path("."), [task.name], [], "full")
    ctx = TaskContext(info, 1, task, model, tokenizer, features, [], torch.device("cpu"))
    loop = StepLoop(model, create_method(SeqFTConfig()), ctx, tokenizer.pad_token_id)
    plan = TrainPlan(steps=steps, batch_size=batch_size, lr=1e-3, seed=0)
    start = time.perf_counter()
    loop.run(features, plan)
    return steps / (time.perf_counter() - start)


def time_hf_trainer(steps: int, batch_size: int, workdir: Path) -> float:
    tokenizer, _, features = _setup(batch_size)
    model = build_tiny_model(ModelConfig().tiny, len(tokenizer), seed=0)
    args = TrainingArguments(
        output_dir=str(workdir),
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=features,
        data_collator=lambda feats: collate(feats, tokenizer.pad_token_id),
    )
    start = time.perf_counter()
    trainer.train()
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON report goes")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    ours: list[float] = []
    theirs: list[float] = []
    workdir = Path(tempfile.mkdtemp(prefix="forgetless-hf-bench-"))
    for repeat in range(args.repeats):
        pair = [
            lambda: ours.append(time_forgetless(args.steps, args.batch_size)),
            lambda: theirs.append(time_hf_trainer(args.steps, args.batch_size, workdir)),
        ]
        for run in pair if repeat % 2 == 0 else pair[::-1]:
            run()
    ratio = statistics.median(ours) / statistics.median(theirs)
    report = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "forgetless_steps_per_s": ours,
        "hf_trainer_steps_per_s": theirs,
        "torch_threads": torch.get_num_threads(),
        "ratio_of_medians": round(ratio, 3),
        "target": ">= 0.95",
    }
    atomic_write_json(args.out, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
