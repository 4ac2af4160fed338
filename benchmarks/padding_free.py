"""Padded against padding-free (packed) micro-batches on the tiny model: tokens per step, the
pad share, and the median step time, each mode timed in turns on the same data and weights.

The examples mix two built-in tasks of different lengths (``--tasks``), so a padded batch
wastes slots; a packed batch computes only real tokens. Equal losses are checked, not assumed.

Run: ``python benchmarks/padding_free.py [--steps 20] [--repeats 3] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from forgetless.config.schema import TinyModelConfig, method_config
from forgetless.contract.method import create_method
from forgetless.contract.plan import TrainPlan
from forgetless.engine.loop import StepLoop
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.testing import task_context


def features(tasks: list[str], n_train: int) -> list[Any]:
    model = build_tiny_model(TinyModelConfig(), len(build_char_tokenizer()), seed=0)
    out: list[Any] = []
    for index in range(1, len(tasks) + 1):
        ctx = task_context(model, tasks, index=index, n_train=n_train, max_length=128)
        out.extend(ctx.train_features)
    return out


def timed(feats: list[Any], padding_free: bool, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    model = build_tiny_model(TinyModelConfig(), len(build_char_tokenizer()), seed=0).to(device)
    model.config._attn_implementation = args.attention
    ctx = task_context(model, args.tasks.split(","), n_train=4)
    ctx.device = device
    stamps: list[float] = []
    loop = StepLoop(
        model,
        create_method(method_config({"name": "seq_ft"})),
        ctx,
        pad_id=0,
        on_step=lambda task, terms: stamps.append(time.perf_counter()),
    )
    plan = TrainPlan(
        steps=args.steps, batch_size=args.batch_size, lr=1e-3, seed=0, padding_free=padding_free
    )
    start = time.perf_counter()
    stats = loop.run(feats, plan)
    steps = [b - a for a, b in zip([start, *stamps[:-1]], stamps, strict=True)][args.warmup :]
    return {
        "median_step_ms": 1000 * statistics.median(steps),
        "tokens_per_step": stats.tokens / stats.steps,
        "padding_fraction": stats.padding_fraction,
        "losses": stats.losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="copy,reverse")
    parser.add_argument("--n-train", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    feats = features(args.tasks.split(","), args.n_train)
    runs: dict[str, list[dict[str, Any]]] = {"padded": [], "packed": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(timed(feats, mode == "packed", args))
    report = {
        mode: {
            "median_step_ms": round(statistics.median(r["median_step_ms"] for r in rs), 2),
            "tokens_per_step": rs[0]["tokens_per_step"],
            "padding_fraction": rs[0]["padding_fraction"],
        }
        for mode, rs in runs.items()
    }
    gap = max(
        abs(a - b)
        for a, b in zip(runs["packed"][0]["losses"], runs["padded"][0]["losses"], strict=True)
    )
    report["max_loss_gap"] = gap  # type: ignore[assignment]
    report["step_time_ratio"] = round(  # type: ignore[assignment]
        report["packed"]["median_step_ms"] / report["padded"]["median_step_ms"], 3
    )
    print(json.dumps({"device": args.device, "attention": args.attention, **report}, indent=1))


if __name__ == "__main__":
    main()
