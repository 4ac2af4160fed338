"""The device check's CPU dry run: every case measured, each beside its memory plan
(CI runs it with `make bench-check`; the GPU run is `benchmarks/gpu_check.sh`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_measures_each_case_beside_its_plan(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        check=True,
        capture_output=True,
        env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["method"], r["mode"]) for r in rows} == {
        ("seq_ft", "full"),
        ("ewc", "full"),
        ("seq_ft", "lora"),
        ("ewc", "lora"),
    }
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["peak_mb"] > 0
        assert row["plan_mb"]["peak"] > row["plan_mb"]["weights"] > 0
