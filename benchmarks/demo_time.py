"""Wall time of the built-in demos as a new user meets them: the environment installed, the cache
empty (the tiny base ships in the package, so nothing pretrains). ``forgetless run`` (target
≤ 120 s) and, with ``--bench``, the bench demo that ``make demo`` runs (target ≤ 300 s), each
``--repeats`` times with a fresh empty cache; the report keeps every repeat, so the median comes
with its spread.
Run: ``python benchmarks/demo_time.py [--bench] [--repeats 3] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from forgetless.core.storage import atomic_write_json

OUT = Path(__file__).parent / "results" / "demo_time.json"


def timed_demo(cache: Path, out: Path, bench: bool) -> float:
    env = {**os.environ, "FORGETLESS_CACHE": str(cache)}
    verb = ["bench", "--seeds", "1", "--jobs", "2"] if bench else ["run"]
    command = [sys.executable, "-m", "forgetless.cli.app", *verb, "--out", str(out), "--quiet"]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", action="store_true", help="time make demo's bench")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    times = []
    for _ in range(args.repeats):
        work = Path(tempfile.mkdtemp(prefix="forgetless-demo-time-"))
        try:
            times.append(round(timed_demo(work / "cache", work / "out", args.bench), 1))
            name = "bench.json" if args.bench else "results.json"
            results = json.loads((work / "out" / name).read_text())
        finally:
            shutil.rmtree(work, ignore_errors=True)
    report: dict[str, object] = {
        "cold_seconds": statistics.median(times),
        "cold_seconds_repeats": times,
        "target_seconds": 300 if args.bench else 120,
        "cache": "empty (shipped base)",
    }
    if args.bench:
        report |= {"runs": results["runs"]}
    else:
        report |= {
            "metrics": results["metrics"],
            "accuracy_matrix": results["accuracy_matrix"],
            "probe_accuracy": results["probe_accuracy"],
        }
    out = args.out or (OUT.with_name("demo_bench_time.json") if args.bench else OUT)
    atomic_write_json(out, report)
    print(json.dumps({k: report[k] for k in ("cold_seconds", "cold_seconds_repeats")}))


if __name__ == "__main__":
    main()
