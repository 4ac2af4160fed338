"""Wall time of the built-in demos, cold (empty cache, so the tiny base is pretrained first) and
warm (base model cached): ``forgetless run`` (targets: 5 min cold, 2 min warm) and, with
``--bench``, the bench demo that ``make demo`` runs (target: 10 min cold).
Run: ``python benchmarks/demo_time.py [--bench] [--out FILE]``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from forgetless.core.storage import atomic_write_json

OUT = Path(__file__).parent / "results" / "demo_time.json"


def timed_demo(cache: Path, out: Path, bench: bool) -> float:
    env = {**os.environ, "FORGETLESS_CACHE": str(cache)}
    verb = ["bench", "--seeds", "1"] if bench else ["run"]
    command = [sys.executable, "-m", "forgetless.cli.app", *verb, "--out", str(out), "--quiet"]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    bench = "--bench" in sys.argv[1:]
    work = Path(tempfile.mkdtemp(prefix="forgetless-demo-bench-"))
    try:
        cold = timed_demo(work / "cache", work / "cold", bench)
        warm = timed_demo(work / "cache", work / "warm", bench)
        name = "bench.json" if bench else "results.json"
        results = json.loads((work / "warm" / name).read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report: dict[str, object] = {"cold_seconds": round(cold, 1), "warm_seconds": round(warm, 1)}
    if bench:
        report |= {"targets": {"cold_seconds": 600}, "runs": results["runs"]}
    else:
        report |= {
            "targets": {"cold_seconds": 300, "warm_seconds": 120},
            "metrics": results["metrics"],
            "accuracy_matrix": results["accuracy_matrix"],
            "probe_accuracy": results["probe_accuracy"],
        }
    out = OUT.with_name("demo_bench_time.json") if bench else OUT
    if "--out" in sys.argv[1:]:
        out = Path(sys.argv[sys.argv.index("--out") + 1])
    atomic_write_json(out, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
