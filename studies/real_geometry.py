"""Geometry as a forgetting predictor, from the real-model campaign's own runs (issue 21, 003).

    python studies/real_geometry.py [RUN_DIR ...]   (default: runs/real*/VARIANT/sN)

Each run folder must still hold its task checkpoints and match a record kept in
``studies/results/campaigns/real.jsonl.gz`` (same variant, seed and config key): the geometry is
read from the campaign's runs, not from runs made for it. Every method's runs count; a four-task
sequence gives three points a run, too few for a correlation inside one run, so the statistic is
the correlation inside runs with run and position fixed effects, its interval a jackknife over
runs (``forgetless.diagnostics.within_run``). Rows are kept by variant and seed in
``studies/results/real-geometry/geometry-real.json`` and merged with what is there, so runs
diagnosed on another machine stay in; ``render_tables.py`` renders the claims from that file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
from run_all import commit, machine
from runs import kept_record, pack_path, read_pack

from forgetless.bench.campaign import config_key
from forgetless.config.loading import read_yaml, validate_config
from forgetless.core.storage import atomic_write_json
from forgetless.diagnostics.diagnose_geometry import (
    LOGLIK_TARGET,
    task_signals,
    within_run_summary,
)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "studies" / "results" / "real-geometry" / "geometry-real.json"


def campaign_run(run: Path, kept: dict[str, Any]) -> str | None:
    """``VARIANT/sN`` when ``run`` is a finished run the campaign kept under the same config."""
    if not (run / "checkpoints").is_dir() or not (run / "config.yaml").is_file():
        return None
    cfg = validate_config(read_yaml(run / "config.yaml"), source=str(run / "config.yaml"))
    record = kept_record(kept, f"cpu/{run.parent.name}/{run.name}", config_key(cfg))
    return f"{run.parent.name}/{run.name}" if record is not None else None


def diagnosed_rows(runs: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Each kept run's geometry rows, keyed by ``VARIANT/sN`` (the run's id in the rows)."""
    found: dict[str, list[dict[str, Any]]] = {}
    kept = read_pack(pack_path("real"))
    for run in runs:
        name = campaign_run(run, kept)
        if name is None:
            print(f"skipped {run}: not a finished run kept by the campaign", file=sys.stderr)
            continue
        found[name] = [{**row, "run": name} for row in task_signals(run)]
        print(f"diagnosed {name} ({run})", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    runs = args.runs or sorted(ROOT.glob("runs/real*/*/s*"))
    old = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {}
    by_run: dict[str, list[dict[str, Any]]] = {}
    for row in old.get("rows", []):
        by_run.setdefault(row["run"], []).append(row)
    by_run.update(diagnosed_rows(runs))
    rows = [row for name in sorted(by_run) for row in by_run[name]]
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    report = {
        "schema_version": 1,
        "runs": sorted(by_run),
        "target": LOGLIK_TARGET,
        "rows": rows,
        "within_run": within_run_summary(rows, LOGLIK_TARGET),
        "commit": commit(),
        "machine": machine(threads),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, report)
    print(f"{len(by_run)} runs, {len(rows)} rows → {args.out}")


if __name__ == "__main__":
    main()
