"""Overhead of ``attribution_gate`` against ``seq_ft`` on the demo's tiny model, side by side.

1. Step: one optimizer step with the update gate active (a map over every weight; the pre-step
   snapshot of the trainable weights, AdamW's step, then ``θ ← lerp(θ_before, θ, 1 − R̄)``)
   against one ``seq_ft`` step, same model, data, batches and optimizer; also the paper's gradient
   gate (a hook scaling each gradient). Each case runs in a fresh process, forked after the imports
   (peak memory is its own); cases alternate order over ``--repeats``; ratios are of medians.
2. Relevance pass: seconds per sample of one LRP forward + backward (all parameters), and the
   bytes of the aggregated map at float16 against float32.

Target (issue 6): gated step time <= 1.1x seq_ft's.
Run: ``python benchmarks/attribution_overhead.py [--steps 100] [--repeats 3]``; the report goes to
``benchmarks/results/attribution_overhead.json``. Quick check:
``python benchmarks/attribution_overhead.py --steps 3 --warmup 1 --repeats 1 --out /tmp/a.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from peak_memory import add_step_args, run_forked, timed_steps  # benchmarks/ is on sys.path

from forgetless.attribution.relevance import relevance_session
from forgetless.config.schema import ModelConfig
from forgetless.contract.method import Method, RunInfo, TaskContext, create_method
from forgetless.engine.loop import StepLoop
from forgetless.methods.attribution_gate import AttributionGate, AttributionGateConfig
from forgetless.methods.seq_ft import SeqFTConfig
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import collate, encode_example

OUT = Path(__file__).parent / "results" / "attribution_overhead.json"
TARGETS = {"update_gate_step_time_ratio": 1.1}
CASES = ("seq_ft", "update_gate", "gradient_gate")


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _context(model: Any, tokenizer: Any, n: int) -> TaskContext:
    task = build_builtin_task("reverse", n_train=n, n_eval=4, seed=0)
    features = [encode_example(tokenizer, e, 64) for e in task.train]
    info = RunInfo(0, Path("."), ["cipher", "reverse"], [], "full")
    return TaskContext(info, 2, task, model, tokenizer, features, [], _device())


def _method(case: str, model: Any) -> Method:
    if case == "seq_ft":
        return create_method(SeqFTConfig())
    gate = "update" if case == "update_gate" else "gradient"
    method = AttributionGate(AttributionGateConfig(gate=gate))
    gen = torch.Generator().manual_seed(0)
    method.importance = {
        n: torch.rand(p.shape, generator=gen).half() for n, p in model.named_parameters()
    }
    return method


def run_one(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """One case in this (fresh) process: its record."""
    torch.set_flush_denormal(True)
    device = _device()
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(ModelConfig().tiny, len(tokenizer), seed=0).to(device)
    ctx = _context(model, tokenizer, args.n_train)
    method = _method(case, model)
    handles = method.register_hooks(ctx) if case != "seq_ft" else []
    loop = StepLoop(model, method, ctx, tokenizer.pad_token_id)
    timing = timed_steps(loop, ctx.train_features, args)
    for handle in handles:
        handle.remove()
    record: dict[str, Any] = {
        "case": case,
        "median_step_s": statistics.median(timing["times"]),
        "peak_mb": timing["peak_mb"],
        "memory": timing["memory"],
    }
    if case == "update_gate":
        record["relevance"] = _relevance_pass(model, tokenizer, ctx, args.relevance_samples)
    return record


def _relevance_pass(model: Any, tokenizer: Any, ctx: TaskContext, n: int) -> dict[str, Any]:
    feats = ctx.train_features[:n]
    start = time.perf_counter()
    with relevance_session(model) as score:
        for feat in feats:
            score({k: v.to(ctx.device) for k, v in collate([feat], tokenizer.pad_token_id).items()})
    seconds = (time.perf_counter() - start) / len(feats)
    params = sum(p.numel() for p in model.parameters())
    return {
        "samples": len(feats),
        "seconds_per_sample": seconds,
        "parameters": params,
        "map_bytes_float16": 2 * params,
        "map_bytes_float32": 4 * params,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    add_step_args(parser, OUT)
    parser.add_argument("--relevance-samples", type=int, default=32)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CASES}
    for repeat in range(args.repeats):
        for case in CASES if repeat % 2 == 0 else CASES[::-1]:
            runs[case].append(run_forked(run_one, case, args))

    def median(case: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[case])

    base_step, base_mem = median("seq_ft", "median_step_s"), median("seq_ft", "peak_mb")
    cases = {
        c: {
            "median_step_s": median(c, "median_step_s"),
            "step_time_ratio": round(median(c, "median_step_s") / base_step, 3),
            "peak_mb": median(c, "peak_mb"),
            "peak_memory_ratio": round(median(c, "peak_mb") / base_mem, 3),
        }
        for c in CASES
    }
    measured = {"update_gate_step_time_ratio": cases["update_gate"]["step_time_ratio"]}
    report = {
        "device": str(_device()),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "cases": cases,
        "relevance": runs["update_gate"][0]["relevance"],
        "targets": TARGETS,
        "measured": measured,
        "meets_targets": {k: measured[k] <= v for k, v in TARGETS.items()},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    tmp.replace(args.out)
    for case, row in cases.items():
        print(
            f"{case:14s} step {row['median_step_s'] * 1e3:7.2f} ms  x{row['step_time_ratio']:.3f}"
            f"  peak {row['peak_mb']:.0f} MiB x{row['peak_memory_ratio']:.3f}"
        )
    rel = report["relevance"]
    print(f"relevance pass {rel['seconds_per_sample'] * 1e3:.1f} ms/sample; report: {args.out}")


if __name__ == "__main__":
    main()
