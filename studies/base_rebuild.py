"""Does ``forgetless pretrain`` rebuild the shipped tiny base? Pretrain from scratch under the
default config, then score the rebuild and the shipped base on the same probes; the target is
every probe within ±0.02 of the shipped score.

    python studies/base_rebuild.py [--out studies/results/base_rebuild.json]

About 20 minutes on two cores (12,000 steps). The report keeps both sets of scores, the
weights' hashes (equal only on a machine that reproduces the float arithmetic bit for bit), the
wall time, commit and machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
from run_all import commit, machine

from forgetless.core.storage import atomic_write_json
from forgetless.training.pretrain import SHIPPED_BASE

OUT = Path(__file__).parent / "results" / "base_rebuild.json"
PROBES = ("copy", "upper", "facts", "add")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="forgetless-rebuild-") as work:
        folder = Path(work) / "base"
        start = time.perf_counter()
        command = [sys.executable, "-m", "forgetless", "pretrain", "--quiet", "--out", str(folder)]
        subprocess.run(command, check=True)
        seconds = time.perf_counter() - start
        rebuilt = json.loads((folder / "pretrain.json").read_text(encoding="utf-8"))
        rebuilt_hash = _sha256(folder / "model.safetensors")
    shipped = json.loads((SHIPPED_BASE / "pretrain.json").read_text(encoding="utf-8"))
    gaps = {k: rebuilt["accuracy"][k] - shipped["accuracy"][k] for k in shipped["accuracy"]}
    report = {
        "command": "forgetless pretrain --out FOLDER",
        "commit": commit(),
        "machine": machine(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))),
        "seconds": round(seconds, 1),
        "shipped": {"accuracy": shipped["accuracy"], "fingerprint": shipped["fingerprint"]},
        "rebuilt": {"accuracy": rebuilt["accuracy"], "fingerprint": rebuilt["fingerprint"]},
        "gap": gaps,
        "weights_identical": rebuilt_hash == _sha256(SHIPPED_BASE / "model.safetensors"),
        "target": "every probe within ±0.02 of the shipped base",
        "met": all(abs(gaps[k]) <= 0.02 for k in PROBES),
    }
    atomic_write_json(args.out, report)
    print(json.dumps({k: report[k] for k in ("gap", "weights_identical", "met", "seconds")}))


if __name__ == "__main__":
    main()
