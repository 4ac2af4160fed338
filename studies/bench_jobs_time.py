"""``forgetless bench --jobs 2`` against ``--jobs 1``, one thread per run, side by side: the same
table, in how much wall time. Each repeat runs both sweeps (the order alternating, so neither
always runs on a warmer machine) from empty output folders; the report keeps every repeat's
times and their ratio, and whether the two tables' runs agree metric for metric.
Run: ``python studies/bench_jobs_time.py [--repeats 3] [--methods seq_ft,replay,ewc,kl_sft]``;
the report goes to ``studies/results/bench_jobs_time.json``. Needs the machine to itself.
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

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
from run_all import commit, machine

from forgetless.core.storage import atomic_write_json

OUT = Path(__file__).parent / "results" / "bench_jobs_time.json"


def sweep(out: Path, methods: str, seeds: int, jobs: int) -> tuple[float, list[dict[str, Any]]]:
    command = [sys.executable, "-m", "forgetless", "bench", "--methods", methods]
    command += ["--seeds", str(seeds), "--jobs", str(jobs), "--threads", "1"]
    command += ["--out", str(out), "--quiet"]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    runs = json.loads((out / "bench.json").read_text(encoding="utf-8"))["runs"]
    return seconds, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="seq_ft,replay,ewc,kl_sft")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    repeats = []
    for index in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            found: dict[int, tuple[float, list[dict[str, Any]]]] = {}
            for jobs in (1, 2) if index % 2 == 0 else (2, 1):
                found[jobs] = sweep(Path(folder, f"jobs{jobs}"), args.methods, args.seeds, jobs)
        same = [a["metrics"] for a in found[1][1]] == [b["metrics"] for b in found[2][1]]
        one, two = found[1][0], found[2][0]
        repeats.append({"jobs1": round(one, 1), "jobs2": round(two, 1), "ratio": two / one})
        repeats[-1]["same_metrics"] = same
        print(repeats[-1], flush=True)
    ratios = [r["ratio"] for r in repeats]
    atomic_write_json(
        args.out,
        {
            "command": f"forgetless bench --methods {args.methods} --seeds {args.seeds} "
            "--threads 1 --jobs 1|2",
            "repeats": repeats,
            "median_ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "all_same_metrics": all(r["same_metrics"] for r in repeats),
            "commit": commit(),
            "machine": machine(1),
        },
    )


if __name__ == "__main__":
    main()
