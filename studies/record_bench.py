"""Run a ``forgetless bench`` and keep its raw results for the commit: ``bench-NAME.json`` in
``studies/results/`` is the bench's ``bench.json`` plus its provenance (command, commit,
machine, the resolved config of the first run). Tables and verdicts are rendered from these
files by code.

    python studies/record_bench.py baselines -- --methods seq_ft,replay --seeds 3

Everything after ``--`` goes to ``forgetless bench``; its output folder is ``runs/bench-NAME``
unless given, and a re-run resumes the bench where it stopped. ``--recorded`` keeps the bench
already finished in that folder without running it again (a bench whose runs' stored configs a
later change of the config schema keeps from resuming); its command is then the one given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
import yaml
from run_all import commit, machine

from forgetless.core.storage import atomic_write_json

RESULTS = Path(__file__).parent / "results"


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the report is studies/results/bench-NAME.json")
    parser.add_argument(
        "--recorded", action="store_true", help="keep the finished bench in --out, run nothing"
    )
    args = parser.parse_args(argv[:cut])
    bench_args = argv[cut + 1 :]
    if "--out" not in bench_args:
        bench_args += ["--out", f"runs/bench-{args.name}"]
    out = Path(bench_args[bench_args.index("--out") + 1])
    command = [sys.executable, "-m", "forgetless", "bench", "--quiet", *bench_args]
    if args.recorded:
        del command[4]  # the command that ran it, not this one
    else:
        subprocess.run(command, check=True)
    bench = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    first = Path(bench["runs"][0]["folder"]) / "config.yaml"
    bench["provenance"] = {
        "command": "forgetless " + " ".join(command[3:]),
        "commit": commit(),
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "machine": machine(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))),
        "config": yaml.safe_load(first.read_text(encoding="utf-8")) if first.is_file() else None,
    }
    target = RESULTS / f"bench-{args.name}.json"
    atomic_write_json(target, bench)
    print(f"{target}: {len(bench['runs'])} runs")


if __name__ == "__main__":
    main()
