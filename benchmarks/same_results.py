"""Does a change leave results alone? Run one fixed bench with two source trees and compare every
run's accuracy matrix, probe scores, KL drift, final losses and loss terms (timings left out).

    git worktree add /tmp/before <commit>
    python benchmarks/same_results.py --before /tmp/before/src --after src

Both trees run in subprocesses on the same tiny model (built once, under a seed) and config; the
exit status is 1 when any run differs. A variant whose default changed between the trees must be
pinned in ``--methods`` (for example ``task_arithmetic@scaling=0.5``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from run_all import machine  # benchmarks/ is on sys.path

from forgetless.core.storage import atomic_write_json
from forgetless.testing import save_tiny

METHODS = (
    "seq_ft,replay,ewc,kl_sft,low_lr,freeze,task_arithmetic@scaling=0.5,ties,opcm,"
    "attribution_gate,sae_fd"
)
CONFIG = {
    "seed": 0,
    "train": {"steps": 15, "batch_size": 8, "lr": 3.0e-3, "max_length": 32},
    "eval": {"n_eval": 16, "n_train": 64, "batch_size": 16, "kl_examples": 8},
    "tasks": ["reverse", "cipher"],
    "probes": ["copy"],
}
COMPARED = ("accuracy_matrix", "probe_accuracy", "kl_drift")


def bench(src: str, config: Path, methods: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "forgetless", "bench", str(config), "--methods", methods]
    subprocess.run([*command, "--seeds", "1", "--out", str(out), "--quiet"], env=env, check=True)


def runs(folder: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(folder.glob("*/s*/results.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        record = {k: data[k] for k in COMPARED}
        record["per_task"] = [(p["final_loss"], p["loss_terms"]) for p in data["per_task"]]
        out[str(path.relative_to(folder).parent)] = record
    return out


def _commit(src: str) -> str:
    done = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="src folder of the tree before")
    parser.add_argument("--after", required=True, help="src folder of the tree after")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--out", type=Path, default=None, help="also write the report here (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="same-results-") as tmp:
        root = Path(tmp)
        model = save_tiny(root / "model")
        config = root / "bench.yaml"
        config.write_text(yaml.safe_dump({**CONFIG, "model": {"name_or_path": str(model)}}))
        bench(args.before, config, args.methods, root / "before")
        bench(args.after, config, args.methods, root / "after")
        before, after = runs(root / "before"), runs(root / "after")
    differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    report = {"runs": len(before), "identical": len(before) - len(differ), "differ": differ}
    print(json.dumps(report))
    if args.out is not None:
        provenance = {
            "before": _commit(args.before),
            "after": _commit(args.after),
            "methods": args.methods,
            "config": CONFIG,
            "machine": machine(1),
        }
        atomic_write_json(args.out, {**report, **provenance})
    sys.exit(1 if differ or not before else 0)


if __name__ == "__main__":
    main()
