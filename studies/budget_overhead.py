"""Overhead of a forgetting budget's checks (issue 23, target (c): ≤ 1.15× a plain run's wall time).

For each method, the run of ``configs/claims-budget.yaml`` without a budget and the same run with
``budget={max_loss: 0.05}`` at the defaults (a check every 5% of a task's steps on a probe batch
of 128, rollback), side by side: each repeat runs both, one after the other, each in a fresh
process on one thread, in an order that alternates over the repeats. The verdict reads the
checks' time over the rest of each budgeted run, measured inside it (the checks alternate with
the steps, so what shares the cores weighs on both alike). Its cross-check is the ratio of the
two runs' CPU time (user + system, start-up included) per repeat: on one thread that is the
command's wall time on an idle core, though where the cores are hyperthreads of one another it
still moves with what runs beside. The budget changes what a run learns, so each run's gain
and its own wall-clock record are kept too.

Run: ``python studies/budget_overhead.py [--repeats 3] [--methods seq_ft,ewc,kl_sft]``; the
report goes to ``studies/results/budget_overhead.json`` (rendered into docs/claims.md by
``budget_claims.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
import yaml
from budget_claims import OVERHEAD, check_overhead  # studies/ is on sys.path
from run_all import commit, machine

from forgetless.core.storage import atomic_write_json

HERE = Path(__file__).parent
OUT = HERE / "results" / "budget_overhead.json"
CONFIG = HERE / "configs" / "claims-budget.yaml"
METHODS = {"seq_ft": {"name": "seq_ft"}, "ewc": {"name": "ewc", "lam": 3.0e4}}
METHODS["kl_sft"] = {"name": "kl_sft", "beta": 0.1}
"""The plain arms of the claims campaign: each method at its configured strength."""
BUDGET = {"max_loss": 0.05}


def run_config(method: dict[str, Any], budget: bool) -> dict[str, Any]:
    """The campaign's run config for ``method``, with the budget at its defaults or none."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg.pop("bench")
    cfg["method"] = method
    return cfg | ({"budget": BUDGET} if budget else {})


def timed_run(cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    """One run in a fresh process on one thread: its CPU time, and its own wall-clock record."""
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = work / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "forgetless.cli.app", "run", str(path), "--out", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([*command, "--quiet"], env=env, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    results = json.loads((out / "results.json").read_text())
    train = sum(t["train_seconds"] for t in results["per_task"])
    checks = sum((t.get("budget") or {}).get("seconds", 0.0) for t in results["per_task"])
    return {
        "cpu_seconds": round(cpu, 2),
        "wall_seconds": round(train + sum(results["eval_seconds"]), 2),
        "train_seconds": round(train, 2),
        "check_seconds": round(checks, 2),
        "gain": results["metrics"]["gain"],
    }


def measure(method: str, repeats: int) -> dict[str, Any]:
    pairs = []
    for repeat in range(repeats):
        order = [False, True] if repeat % 2 == 0 else [True, False]
        pair: dict[str, Any] = {}
        for budget in order:
            with tempfile.TemporaryDirectory(prefix="forgetless-budget-") as work:
                key = "budget" if budget else "plain"
                pair[key] = timed_run(run_config(METHODS[method], budget), Path(work))
        pair["ratio"] = round(pair["budget"]["cpu_seconds"] / pair["plain"]["cpu_seconds"], 4)
        pairs.append(pair)
        print(json.dumps({"method": method, "repeat": repeat, "ratio": pair["ratio"]}), flush=True)
    ratios = [p["ratio"] for p in pairs]
    own = check_overhead([p["budget"] for p in pairs])
    return {
        "check_overhead": own,
        "median_ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "met": own <= OVERHEAD,
        "pairs": pairs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "config": str(CONFIG.relative_to(HERE.parent)),
        "budget": BUDGET,
        "target": OVERHEAD,
        "commit": commit(),
        "machine": machine(1),
        "methods": {m: measure(m, args.repeats) for m in args.methods.split(",")},
    }
    atomic_write_json(args.out, report)
    print(json.dumps({m: r["median_ratio"] for m, r in report["methods"].items()}))


if __name__ == "__main__":
    main()
