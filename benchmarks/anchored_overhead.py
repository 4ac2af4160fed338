"""Overhead of ``anchored`` against ``seq_ft`` on the demo's tiny model, measured side by side.

1. Step: one inner step of anchored (student forward, KL to the cached top-k anchor, backward,
   AdamW) against one seq_ft step (forward, cross-entropy, backward, AdamW), same model, data,
   batches and optimizer. Each case runs in a fresh subprocess (so peak memory is its own), the
   two alternate over ``--repeats``; the ratios are of medians. Peak memory is CUDA's allocator
   peak over the timed steps on a GPU, else the process's peak resident set size
   (``resource.getrusage``); ``training_memory_ratio`` also subtracts an idle process that
   built the same model and data and trained nothing.
2. Cache: bytes per completion token, and the whole cache for the task's data.
3. Task: the total cost of one task through the runner, the reference's training included,
   against seq_ft on the same plan (anchored at matched compute: T outer iterations of
   plan_steps / T inner steps, plus the reference's plan_steps).

Targets (issue 4): step time <= 1.2x and peak memory <= 1.3x seq_ft's.
Run: ``python benchmarks/anchored_overhead.py [--steps 100] [--repeats 3]``; results go to
``benchmarks/results/anchored_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from peak_memory import peak_mb, start_window  # benchmarks/ is on sys.path when run as a script
from rich.console import Console

from forgetless.config.loading import validate_config
from forgetless.config.schema import ModelConfig
from forgetless.contract.method import RunInfo, TaskContext, create_method
from forgetless.contract.plan import TrainPlan
from forgetless.core.storage import atomic_write_json
from forgetless.engine.loop import StepLoop
from forgetless.methods.anchored import AnchorCache, anchor_loss, completion_logprobs
from forgetless.methods.anchored_math import (
    anchor_logprobs,
    cache_bytes_per_token,
    index_dtype,
    topk_anchor,
)
from forgetless.methods.seq_ft import SeqFTConfig
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import Features, collate, encode_example
from forgetless.training.runner import Runner

OUT = Path(__file__).parent / "results" / "anchored_overhead.json"
TARGETS = {"step_time_ratio": 1.2, "peak_memory_ratio": 1.3}


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _setup(n_train: int) -> tuple[Any, Any, list[Features]]:
    tokenizer = build_char_tokenizer()
    task = build_builtin_task("reverse", n_train=n_train, n_eval=10, seed=0)
    features = [
        {**encode_example(tokenizer, e, 64), "index": [i]} for i, e in enumerate(task.train)
    ]
    return tokenizer, task, features


def _loop(model: Any, tokenizer: Any, task: Any, features: list[Features]) -> StepLoop:
    info = RunInfo(0, Path("."), [task.name], [], "full")
    ctx = TaskContext(info, 1, task, model, tokenizer, features, [], _device())
    return StepLoop(model, create_method(SeqFTConfig()), ctx, tokenizer.pad_token_id)


def build_cache(work: Path, n_train: int, top_k: int, alpha: float, space: str) -> dict[str, Any]:
    """The anchor cache the inner step reads: student = the tiny model, reference = a copy
    trained 20 SFT steps on the data (content does not change the step's cost)."""
    tokenizer, task, features = _setup(n_train)
    device = _device()
    model = build_tiny_model(ModelConfig().tiny, len(tokenizer), seed=0).to(device)
    reference = build_tiny_model(ModelConfig().tiny, len(tokenizer), seed=0).to(device)
    _loop(reference, tokenizer, task, features).run(
        features, TrainPlan(steps=20, batch_size=32, lr=1e-3, seed=1)
    )
    parts, offsets = [], [0]
    with torch.no_grad():
        for lo in range(0, len(features), 64):
            batch = collate(features[lo : lo + 64], tokenizer.pad_token_id)
            batch = {k: v.to(device) for k, v in batch.items()}
            logp, logp_sft = (
                completion_logprobs(model, batch),
                completion_logprobs(reference, batch),
            )
            values, indices, tail = topk_anchor(
                anchor_logprobs(logp, logp_sft, alpha, space), top_k
            )  # type: ignore[arg-type]
            parts.append((values, indices.to(index_dtype(len(tokenizer))), tail))
            counts = (batch["labels"][:, 1:] != -100).sum(1).cumsum(0)
            offsets.extend((offsets[-1] + counts).tolist())
    cache = AnchorCache(*(torch.cat([p[i] for p in parts]).cpu() for i in range(3)), offsets)
    torch.save(
        {"values": cache.values, "indices": cache.indices, "tail": cache.tail, "offsets": offsets},
        work / "cache.pt",
    )
    return {
        "top_k": min(top_k, len(tokenizer)),
        "vocab_size": len(tokenizer),
        "bytes_per_token": cache_bytes_per_token(top_k, len(tokenizer)),
        "tokens": int(cache.values.size(0)),
        "bytes": cache.nbytes,
        "examples": len(features),
    }


def run_case(case: str, work: Path, n_train: int, steps: int, warmup: int, batch: int) -> None:
    """One case in this (fresh) process; prints one JSON line."""
    torch.set_flush_denormal(True)
    tokenizer, task, features = _setup(n_train)
    device = _device()
    model = build_tiny_model(ModelConfig().tiny, len(tokenizer), seed=0).to(device)
    loss_fn = None
    if case == "anchored":
        saved = torch.load(work / "cache.pt")
        cache = AnchorCache(
            saved["values"].to(device),
            saved["indices"].to(device),
            saved["tail"].to(device),
            saved["offsets"],
        )
        loss_fn = anchor_loss(cache)
    stamps: list[float] = []
    loop = _loop(model, tokenizer, task, features)
    loop.on_step = lambda name, terms: stamps.append(time.perf_counter())
    if case != "idle":
        loop.run(features, TrainPlan(steps=warmup, batch_size=batch, lr=1e-3, seed=0), loss_fn)
    hwm_reset = start_window(device)
    if case != "idle":
        stamps.clear()
        start = time.perf_counter()
        loop.run(features, TrainPlan(steps=steps, batch_size=batch, lr=1e-3, seed=0), loss_fn)
        times = [b - a for a, b in zip([start, *stamps[:-1]], stamps, strict=True)]
    else:
        times = [0.0]
    peak, measure = peak_mb(device, hwm_reset)
    record = {"case": case, "median_step_s": statistics.median(times), "peak_mb": peak}
    print(json.dumps({**record, "memory": measure}))


def _subprocess(case: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--case",
        case,
        "--work",
        str(work),
        "--n-train",
        str(args.n_train),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--threads",
        str(args.threads),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def task_cost(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One task through the runner: seq_ft and anchored (reference + T x inner) on one plan."""
    tokenizer = build_char_tokenizer()
    model_dir = work / "tiny"
    build_tiny_model(ModelConfig().tiny, len(tokenizer), seed=0).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    T = args.outer_iterations
    methods = {
        "seq_ft": {"name": "seq_ft"},
        "anchored": {
            "name": "anchored",
            "outer_iterations": T,
            "inner_steps": max(1, args.plan_steps // T),
            "top_k": args.top_k,
        },
    }
    out: dict[str, Any] = {}
    for name, method in methods.items():
        raw = {
            "seed": 0,
            "model": {"name_or_path": str(model_dir)},
            "train": {"steps": args.plan_steps, "batch_size": args.batch_size, "lr": 1e-3},
            "eval": {"n_eval": 4, "n_train": args.n_train, "batch_size": 4, "kl_drift": False},
            "tasks": ["reverse"],
            "method": method,
        }
        runner = Runner(validate_config(raw), work / name, Console(quiet=True), progress=False)
        stats = runner.run().per_task[0]
        out[name] = {
            "steps": stats["steps"],
            "train_seconds": stats["train_seconds"],
            **({"cost": stats["details"]["cost"]} if "details" in stats else {}),
        }
    out["time_ratio"] = round(out["anchored"]["train_seconds"] / out["seq_ft"]["train_seconds"], 3)
    out["anchored_settings"] = methods["anchored"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--space", default="logit", choices=["logit", "prob"])
    parser.add_argument("--plan-steps", type=int, default=100, help="task plan for the cost run")
    parser.add_argument("--outer-iterations", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON report goes")
    parser.add_argument("--case", choices=["seq_ft", "anchored", "idle"], help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.case:
        run_case(args.case, args.work, args.n_train, args.steps, args.warmup, args.batch_size)
        return
    work = Path(tempfile.mkdtemp(prefix="forgetless-anchored-bench-"))
    cache = build_cache(work, args.n_train, args.top_k, args.alpha, args.space)
    runs: dict[str, list[dict[str, Any]]] = {"seq_ft": [], "anchored": [], "idle": []}
    for repeat in range(args.repeats):
        order = ["seq_ft", "anchored"] if repeat % 2 == 0 else ["anchored", "seq_ft"]
        for case in [*order, "idle"]:
            runs[case].append(_subprocess(case, args, work))

    def median(case: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[case])

    idle = median("idle", "peak_mb")
    seq_mem, anc_mem = median("seq_ft", "peak_mb"), median("anchored", "peak_mb")
    step = {
        "seq_ft_median_step_s": median("seq_ft", "median_step_s"),
        "anchored_median_step_s": median("anchored", "median_step_s"),
        "seq_ft_peak_mb": seq_mem,
        "anchored_peak_mb": anc_mem,
        "idle_peak_mb": idle,
    }
    step["step_time_ratio"] = round(
        step["anchored_median_step_s"] / step["seq_ft_median_step_s"], 3
    )
    step["peak_memory_ratio"] = round(anc_mem / seq_mem, 3)
    on_cpu = _device().type == "cpu"
    if on_cpu:
        step["training_memory_ratio"] = round((anc_mem - idle) / max(seq_mem - idle, 1e-9), 3)
    report = {
        "device": str(_device()),
        "settings": {k: v for k, v in vars(args).items() if k not in ("case", "work", "out")},
        "memory_measure": "process peak RSS over the timed steps (VmHWM reset after warm-up)"
        if on_cpu
        else "CUDA allocator peak",
        "step": step,
        "targets": TARGETS,
        "meets_targets": {k: step[k] <= v for k, v in TARGETS.items()},
        "cache": cache,
        "task_cost": task_cost(work, args),
        "runs": runs,
    }
    atomic_write_json(args.out, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
