"""Is each instruct task learnable within the real track's budget? For every task: the base's
exact-match accuracy, and the accuracy after training on that task alone with the
``--preset smollm2`` budget (LoRA r 8 on the top 8 layers, 100 steps of 8, lr 5e-4), seed 0.

    python studies/real_tasks.py [--tasks it-json,it-arith] [--n-eval 48]

About 3 minutes a task on two cores. Needs the model (``make smollm2``). Writes
``studies/results/real_tasks.json`` with the commit and the machine; a re-run skips the
tasks already in it under the same settings.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
import torch
from rich.console import Console
from run_all import commit, machine

from forgetless.config.loading import validate_config
from forgetless.config.presets import smollm2_config_dict
from forgetless.core.storage import atomic_write_json
from forgetless.tasks.instruct import INSTRUCT_TASKS
from forgetless.training.runner import Runner

OUT = Path(__file__).parent / "results" / "real_tasks.json"


def alone_config(task: str, n_eval: int) -> dict[str, Any]:
    data = copy.deepcopy(smollm2_config_dict())
    data["tasks"], data["probes"] = [task], []
    data["eval"].update(n_eval=n_eval, prose=False, kl_drift=False, loglik_examples=0)
    data["eval"]["cache_base_row"] = False
    return data


def measure(task: str, n_eval: int) -> dict[str, Any]:
    cfg = validate_config(alone_config(task, n_eval), f"task {task}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        results = Runner(cfg, Path(folder), Console(quiet=True), progress=False).run()
    data = results.to_json()
    return {
        "skill": INSTRUCT_TASKS[task].skill,
        "base": data["accuracy_matrix"][0][0],
        "alone": data["accuracy_matrix"][1][0],
        "final_loss": data["per_task"][0]["final_loss"],
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(INSTRUCT_TASKS))
    parser.add_argument("--n-eval", type=int, default=48)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    settings = {"n_eval": args.n_eval, "config": alone_config("TASK", args.n_eval)}
    report = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {}
    if report.get("settings") != settings:
        report = {"settings": settings, "tasks": {}}
    for task in args.tasks.split(","):
        if task in report["tasks"]:
            continue
        report["tasks"][task] = measure(task, args.n_eval)
        report.update(commit=commit(), machine=machine(torch.get_num_threads()))
        atomic_write_json(args.out, report)
        row = report["tasks"][task]
        print(f"{task}: base {row['base']:.2f} -> alone {row['alone']:.2f} ({row['seconds']} s)")


if __name__ == "__main__":
    main()
