"""Profile one method's training on the demo's tiny model: where a task's time goes.

The method's state is built over ``--past`` past tasks (``method_harness``), then the next task
runs as ``task_growth.py`` times it (a step-loop method's warm-up and timed steps; a stage
method's whole ``train_task``) under pyinstrument, the Python call tree (runner, method hooks,
optimizer), and under ``torch.profiler``, the kernels. Writes
``<out-dir>/<method>-<mode>-past<P>.txt`` (both, as text) and ``.html`` (pyinstrument's page, to
open in a browser). Profiling slows every call, so the share of each part matters here, not the
seconds: the timings themselves come from the other benchmarks.

Run: ``python benchmarks/profile_step.py attribution_gate [--mode full] [--past 1] [--steps 20]``.
Needs ``pip install -e ".[bench]"`` (pyinstrument).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from method_harness import Bench, add_harness_args  # benchmarks/ is on sys.path

from forgetless.core.storage import atomic_write_text

OUT_DIR = Path(__file__).parent / "results" / "profiles"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method", help="a registered method's name")
    parser.add_argument("--mode", choices=("full", "lora"), default="full")
    parser.add_argument("--past", type=int, default=1, help="past tasks before the profiled one")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument("--ops", type=int, default=20, help="kernels listed")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    add_harness_args(parser)
    args = parser.parse_args()
    try:
        from pyinstrument import Profiler
    except ImportError as err:
        raise SystemExit('profile_step.py needs pyinstrument: pip install -e ".[bench]"') from err
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args.method, args.mode, args)
    while bench.done < args.past:
        bench.past_task()
    profiler = Profiler(interval=0.001)
    with torch.profiler.profile() as kernels:
        profiler.start()
        row = bench.timed_task()
        profiler.stop()
    stem = args.out_dir / f"{args.method}-{args.mode}-past{args.past}"
    table = kernels.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops)
    header = (
        f"# {args.method} ({args.mode}), task {row['task_index']} after {args.past} past "
        f"task(s): {row['timed_steps']} steps, median step {row['step_s'] * 1e3:.1f} ms "
        "(profiled)\n\n"
    )
    text = profiler.output_text(unicode=True, color=False, show_all=False)
    atomic_write_text(
        stem.with_suffix(".txt"), f"{header}## Python\n\n{text}\n## Kernels\n\n{table}\n"
    )
    atomic_write_text(stem.with_suffix(".html"), profiler.output_html())
    print(f"profile: {stem}.txt and {stem}.html")


if __name__ == "__main__":
    main()
