"""Every method's training step against ``seq_ft``'s, full fine-tuning and LoRA, side by side.

For each registered method that trains through the step loop (all but ``rl``, see
``method_harness.EXCLUDED``) and each fine-tuning mode it supports (LoRA: the ``carry`` adapter,
O-LoRA its ``per_task`` adapters), one past task builds the method's state and the second task's
steps are timed (``method_harness``). Each measurement runs in a fresh process (forked after
the imports, ``peak_memory.run_forked``), so its peak memory is its own; the cases alternate
order over ``--repeats`` and every ratio is of medians against ``seq_ft`` in the same mode.
``step`` is the median step (for a method with its own stage, the steps it runs through the
loop, a reference model's left out); ``task`` its whole stage over the plan's steps (Anchored
Learning's reference and caches, the merges); ``peak`` the process's peak memory over the timed
task (``VmHWM`` reset after the warm-up, see ``peak_memory.py``).

Run: ``python benchmarks/method_steps.py [--steps 30] [--repeats 3]``; the report goes to
``benchmarks/results/method_steps.json``. Quick check: ``python benchmarks/method_steps.py
--steps 2 --warmup 1 --repeats 1 --n-train 32 --methods seq_ft,ewc --out /tmp/ms.json``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from method_harness import (  # benchmarks/ is on sys.path
    EXCLUDED,
    add_harness_args,
    alternated,
    measure,
    median_of,
    methods,
    supports,
)
from peak_memory import add_step_args, run_forked
from run_all import machine

from forgetless.core.storage import atomic_write_json

OUT = Path(__file__).parent / "results" / "method_steps.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(parser, OUT)
    add_harness_args(parser)
    parser.add_argument("--methods", default="all", help="comma-separated, or all")
    parser.add_argument("--modes", default="full,lora")
    parser.set_defaults(steps=30)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = methods() if args.methods == "all" else ["seq_ft", *args.methods.split(",")]
    names = list(dict.fromkeys(names))
    cases = [(n, m) for m in args.modes.split(",") for n in names if supports(n, m)]

    def run(name: str, mode: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = run_forked(measure, name, mode, args, [1])
        return rows

    load_before = os.getloadavg()[0]
    runs = alternated(cases, args.repeats, run)
    rows = summarize({c: [r[0] for r in rs] for c, rs in runs.items()})
    report = {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "machine": machine(torch.get_num_threads()),
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "excluded": EXCLUDED,
        "rows": rows,
        "runs": {f"{n}/{m}": rs for (n, m), rs in runs.items()},
    }
    atomic_write_json(args.out, report)
    for row in rows:
        print(
            f"{row['method']:17s} {row['mode']:4s} step x{row['step_ratio']:.3f} "
            f"task x{row['task_ratio']:.3f} peak x{row['peak_ratio']:.3f}"
        )
    print(f"report: {args.out}")


def summarize(runs: dict[tuple[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Medians per case and their ratios to seq_ft's in the same mode."""
    rows = []
    for (name, mode), records in runs.items():
        base = runs[("seq_ft", mode)]
        step, task, peak = (median_of(records, k) for k in ("step_s", "task_s_per_step", "peak_mb"))
        rows.append(
            {
                "method": name,
                "mode": mode,
                "step_s": step,
                "task_s_per_step": task,
                "peak_mb": peak,
                "step_ratio": round(step / median_of(base, "step_s"), 3),
                "task_ratio": round(task / median_of(base, "task_s_per_step"), 3),
                "peak_ratio": round(peak / median_of(base, "peak_mb"), 3),
                "state_bytes": records[0]["state_bytes"],
                "task_index": records[0]["task_index"],
            }
        )
    return rows


if __name__ == "__main__":
    main()
