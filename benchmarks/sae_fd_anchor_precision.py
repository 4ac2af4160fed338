"""Are float16 anchors as good as float32 ones? ``sae_fd`` with each anchor storage type on the
tiny demo sequence, paired by seed: the target is the 95% interval of the per-seed difference in
BWT (float16 − float32) inside ±0.02. Storage halves by construction; only the outcome can fail.

    python benchmarks/sae_fd_anchor_precision.py [--seeds 3] [--out benchmarks/results/...]

The bench folder (``--work``) is kept, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from run_all import commit, machine  # benchmarks/ is on sys.path

from forgetless.bench.stats import mean_interval
from forgetless.core.storage import atomic_write_json

OUT = Path(__file__).parent / "results" / "sae_fd_anchor_precision.json"
VARIANTS = {"float16": "sae_fd@anchor_dtype=float16", "float32": "sae_fd@anchor_dtype=float32"}


def paired_difference(runs: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Per seed: the float16 run's metric minus the float32 run's, with their 95% interval."""
    by_seed: dict[int, dict[str, float]] = {}
    for run in runs:
        dtype = next(k for k, v in VARIANTS.items() if run["variant"] == v)
        by_seed.setdefault(run["seed"], {})[dtype] = run["metrics"][metric]
    diffs = [v["float16"] - v["float32"] for _, v in sorted(by_seed.items()) if len(v) == 2]
    interval = mean_interval(diffs)
    if interval is None:
        raise SystemExit(f"no seed has both anchor types for {metric}")
    return {**interval.as_dict(), "per_seed": diffs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("runs/bench-anchor-precision"))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    command = [
        sys.executable, "-m", "forgetless", "bench", "--quiet",
        "--methods", ",".join(VARIANTS.values()),
        "--seeds", str(args.seeds), "--out", str(args.work),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    bench = json.loads((args.work / "bench.json").read_text(encoding="utf-8"))
    report = {
        "command": " ".join(command[2:]),
        "commit": commit(),
        "machine": machine(os.cpu_count() or 1),
        "bwt_difference": paired_difference(bench["runs"], "bwt"),
        "retention_difference": paired_difference(bench["runs"], "retention"),
        "target": "95% interval of the paired BWT difference within ±0.02",
        "runs": bench["runs"],
    }
    diff = report["bwt_difference"]
    report["met"] = diff["low"] >= -0.02 and diff["high"] <= 0.02
    atomic_write_json(args.out, report)
    print(json.dumps({k: report[k] for k in ("bwt_difference", "met")}))


if __name__ == "__main__":
    main()
