"""What each diagnostic costs on a real-model run: every command timed whole, as a user runs it.

    python studies/real_diagnostics.py RUN_DIR [--only geometry,attribution,circuits,sae]

RUN_DIR is a finished `--preset smollm2` run (e.g. a campaign run's folder). The commands:
``diagnose geometry RUN_DIR``; ``diagnose attribution RUN_DIR --samples 8`` (with its same-model
control); ``export`` of the last task's model, then ``diagnose circuits`` of the base and that
model on the question set's free answers (all 270 heads, first-order effects); ``sae train
--preset smollm2 --steps 1500 --expansion 4 --autocast bf16`` into a scratch folder. Writes
``studies/results/real_diagnostics.json`` (seconds, the command, its output's summary, and
the commit and machine of each command); a re-run skips the commands already in it for the same
run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
from run_all import commit, machine

from forgetless.core.storage import atomic_write_json

OUT = Path(__file__).parent / "results" / "real_diagnostics.json"
CLI = [sys.executable, "-m", "forgetless"]
SAE = ["--steps", "1500", "--expansion", "4", "--autocast", "bf16", "--quiet"]
"""Half the default steps and width: D = 2304 features of the 576-wide MLP output, collected and
trained under bf16 autocast as the preset trains (in float32 the command took 1312.8 s beside
two other jobs, kept in the report as ``sae_fp32``)."""
CIRCUITS = ["--effects", "attribution", "--steps", "40", "--lr", "0.25"]
"""First-order head effects (two backward passes, not 542 masked forwards) and a shorter DBM at
a larger step: the default 200 steps and 542 forwards did not finish in 80 minutes of CPU time.
``studies/circuits_agreement.py`` checks the first-order effects against exact patching."""


def commands(run: Path, scratch: Path) -> dict[str, list[list[str]]]:
    model, base = str(scratch / "after-last"), "smollm2-135m-instruct"
    out = {name: ["--out", str(scratch / f"{name}.json")] for name in ("geometry", "attribution")}
    circuits = [
        *["--behaviour", "gk-short", "--n", "16", *CIRCUITS],
        *["--out", str(scratch / "circuits.json")],
    ]
    return {
        "geometry": [["diagnose", "geometry", str(run), *out["geometry"]]],
        "attribution": [["diagnose", "attribution", str(run), "--samples=8", *out["attribution"]]],
        "circuits": [["export", str(run), model], ["diagnose", "circuits", base, model, *circuits]],
        "sae": [["sae", "train", "--preset", "smollm2", *SAE, "--out", str(scratch / "sae")]],
    }


def summary(name: str, scratch: Path) -> dict[str, Any]:
    """The few figures that say the command did its work."""
    if name == "sae":
        record = json.loads((scratch / "sae" / "sae_config.json").read_text(encoding="utf-8"))
        return {key: record.get(key) for key in ("metrics", "train_tokens", "sources")}
    data = json.loads((scratch / f"{name}.json").read_text(encoding="utf-8"))
    if name == "circuits":
        return {"rows": data["rows"]}
    if name == "attribution":
        return {"per_task": data["per_task"], "sequential_mean": data["sequential_mean"]}
    return {"keys": sorted(data)}


def timed(argv: list[list[str]]) -> tuple[float, str]:
    start, tail = time.perf_counter(), ""
    for args in argv:
        done = subprocess.run([*CLI, *args], capture_output=True, text=True, check=False)
        tail = (done.stdout + done.stderr)[-2000:]
        if done.returncode:
            raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{tail}")
    return time.perf_counter() - start, tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--only", default="geometry,attribution,circuits,sae")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    report = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {}
    if report.get("run") != str(args.run):
        report = {"run": str(args.run), "commands": {}}
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        for name in args.only.split(","):
            if name in report["commands"]:
                continue
            argv = commands(args.run, scratch)[name]
            load = os.getloadavg()[0]  # other jobs on the cores, recorded beside the time
            seconds, tail = timed(argv)
            report["commands"][name] = {
                "seconds": round(seconds, 1),
                "argv": [" ".join(["forgetless", *a]) for a in argv],
                "summary": summary(name, scratch),
                "output_tail": tail,
                "commit": commit(),
                "load_before": round(load, 2),
                "machine": machine(threads),  # each command's own: re-runs may be elsewhere
            }
            atomic_write_json(args.out, report)
            print(f"{name}: {seconds:.1f} s", flush=True)
            shutil.rmtree(scratch / "after-last", ignore_errors=True)


if __name__ == "__main__":
    main()
