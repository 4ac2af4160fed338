"""Batched head masking against the one-head-at-a-time loop, on the demo's tiny model.

1. Effects: necessity and sufficiency of all N heads. Batched: the prompt batch tiled once per
   mask (2N + 2 masks) in one forward pass (``head_effects``); loop: one forward per mask
   (``head_effects_loop``). Both give the same numbers (``tests/unit/test_circuits.py``).
2. DBM: one optimisation step masks all N heads in one forward and one backward pass. The loop
   reference is what a one-head-at-a-time scheme needs to see every head once: N forward passes,
   each patching a single head.

Effects are also timed in chunks of 8 masks per pass (``--chunk`` of the CLI), the middle way
when one pass over every tiled copy outgrows the caches.

Per prompt-batch size (1, 4, 32): forward passes of each form and the wall-clock ratio
loop / batched (medians over ``--repeats``). On CPU the batched form turns many small matmuls
into a few large ones, so its gain shrinks as the prompt batch already fills the cores.
Run: ``OMP_NUM_THREADS=1 python benchmarks/circuits_speed.py``; results go to
``benchmarks/results/circuits_speed.json``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from forgetless.config.schema import TinyModelConfig
from forgetless.core.storage import atomic_write_json
from forgetless.diagnostics.circuits import (
    counterfactual,
    head_effects,
    head_effects_loop,
    head_layout,
    masked_logits,
    target_logprob,
    train_masks,
)
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import collate, encode_example

OUT = Path(__file__).parent / "results" / "circuits_speed.json"


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _one_head_sweep(model: torch.nn.Module, batch: dict[str, torch.Tensor], cf: Any) -> None:
    layout = head_layout(model)
    with torch.no_grad():
        for i in range(layout.size):
            mask = torch.ones(layout.size)
            mask[i] = 0.0
            logits = masked_logits(model, batch, mask.view(layout.layers, layout.heads), cf)
            target_logprob(logits, batch["labels"])


def measure(prompts: int, repeats: int) -> dict[str, Any]:
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(), len(tokenizer), seed=0).eval()
    task = build_builtin_task("copy", 0, prompts, seed=0)
    feats = [encode_example(tokenizer, e, 64) for e in task.eval]
    batch = collate(feats, tokenizer.pad_token_id)
    cf = counterfactual(model, batch, "mean")
    layout = head_layout(model)
    batched = head_effects(model, batch, cf)
    loop_passes = 2 * layout.size + 2
    t_batched = _median_seconds(lambda: head_effects(model, batch, cf), repeats)
    t_chunked = _median_seconds(lambda: head_effects(model, batch, cf, chunk=8), repeats)
    t_loop = _median_seconds(lambda: head_effects_loop(model, batch, cf), repeats)
    t_dbm = _median_seconds(lambda: train_masks(model, batch, cf, steps=1), repeats)
    t_sweep = _median_seconds(lambda: _one_head_sweep(model, batch, cf), repeats)
    return {
        "prompts": prompts,
        "heads": layout.size,
        "effects": {
            "batched_forward_passes": batched.forward_passes,
            "loop_forward_passes": loop_passes,
            "batched_seconds": t_batched,
            "loop_seconds": t_loop,
            "loop_over_batched": t_loop / t_batched,
            "chunk8_forward_passes": -(-loop_passes // 8),
            "chunk8_seconds": t_chunked,
            "loop_over_chunk8": t_loop / t_chunked,
        },
        "dbm_step": {
            "batched_passes": "1 forward + 1 backward",
            "loop_forward_passes": layout.size,
            "batched_seconds": t_dbm,
            "loop_seconds": t_sweep,
            "loop_over_batched": t_sweep / t_dbm,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for size in args.sizes:
        row = measure(size, args.repeats)
        e, d = row["effects"], row["dbm_step"]
        print(
            f"prompts {size:>3}: effects {e['batched_forward_passes']} vs "
            f"{e['loop_forward_passes']} passes, loop/batched {e['loop_over_batched']:.2f}x "
            f"(chunks of 8: {e['loop_over_chunk8']:.2f}x) | "
            f"DBM step 1 vs {d['loop_forward_passes']} passes, "
            f"loop/batched {d['loop_over_batched']:.2f}x"
        )
        rows.append(row)
    atomic_write_json(
        args.out,
        {
            "schema_version": 1,
            "model": TinyModelConfig().model_dump(),
            "torch_threads": torch.get_num_threads(),
            "device": "cpu",
            "machine": platform.machine(),
            "repeats": args.repeats,
            "rows": rows,
        },
    )
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
