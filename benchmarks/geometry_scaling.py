"""Time and peak memory of Bures–Wasserstein conflict and of a GCWM layer merge, factored vs dense.

Cases (issue 7): square layers of width d ∈ {1024, 2048, 4096} with task updates of rank
r ∈ {8, 16, 32, 64}; the factored path (``geometry.py`` / ``experimental/gcwm.py``, never a
``d × d`` matrix) against the dense reference (``d × d`` covariances, ``eigh``/SVD), dense only up
to 2048; and the growth with the number of tasks T ∈ {2, 4, 8}. Each case runs in a fresh
subprocess: its inputs are built first, then the memory window is reset (``VmHWM`` where Linux
allows, else ``ru_maxrss``, see ``peak_memory.py``) and the operation is timed once, after a
small warm-up of the same kind. ``peak_mb`` is the process's high-water mark over the timed call;
``input_mb`` is the resident set before it.

Both GCWM paths run the same fixed number of barycenter iterations (``--iterations``, tol 0), so
their work is comparable; a real merge stops at tol 1e-6 (at most 50 iterations).

Run: ``OMP_NUM_THREADS=1 python benchmarks/geometry_scaling.py``; the JSON goes to
``benchmarks/results/geometry_scaling.json`` (written atomically) and a table is printed. Quick
check: ``python benchmarks/geometry_scaling.py --quick --out /tmp/geometry_scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from peak_memory import peak_mb, start_window, status_kb  # benchmarks/ is on sys.path

WIDTHS, RANKS, TASKS = (1024, 2048, 4096), (8, 16, 32, 64), (2, 4, 8)
DENSE_MAX = 2048
RESULTS = Path(__file__).parent / "results" / "geometry_scaling.json"


def plan(quick: bool, ranks: tuple[int, ...] = RANKS) -> list[dict[str, Any]]:
    """Every case as a dict: op (bw or gcwm), path, width, rank, tasks."""
    widths, ranks = ((256, 512), (8, 16)) if quick else (WIDTHS, ranks)
    dense_max = 512 if quick else DENSE_MAX
    cases = []
    for op in ("bw", "gcwm"):
        for d in widths:
            for r in ranks:
                for path in ("lowrank", "dense"):
                    if path == "dense" and d > dense_max:
                        continue
                    cases.append({"op": op, "path": path, "width": d, "rank": r, "tasks": 2})
    growth = [(widths[-1], "lowrank"), (widths[0], "dense")]
    for d, path in growth:
        for t in TASKS[1:] if not quick else (4,):
            cases.append({"op": "gcwm", "path": path, "width": d, "rank": 16, "tasks": t})
    return cases


def _inputs(case: dict[str, Any], seed: int = 0) -> list[Any]:
    from forgetless.diagnostics.geometry import DTYPE, LowRank

    gen = torch.Generator().manual_seed(seed)
    d, r = case["width"], case["rank"]
    ups = [
        LowRank(
            torch.randn(d, r, generator=gen, dtype=DTYPE) / r**0.5,
            torch.randn(r, d, generator=gen, dtype=DTYPE) / d**0.5,
        )
        for _ in range(case["tasks"])
    ]
    return [u.dense() for u in ups] if case["path"] == "dense" else ups


def _operation(case: dict[str, Any], iterations: int) -> Any:
    """A zero-argument callable doing the case's work on its inputs."""
    from forgetless.diagnostics import geometry as g

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from forgetless.experimental.gcwm import GCWMParams, gcwm_layer, gcwm_layer_dense

    inputs = _inputs(case)
    opts = GCWMParams(max_iter=iterations, tol=0.0)
    weights = [1.0] * len(inputs)
    if case["op"] == "bw" and case["path"] == "lowrank":
        a, b = inputs[0], inputs[1]
        return lambda: g.normalized_bw_sq(g.geometry_from_lowrank(a), g.geometry_from_lowrank(b))
    if case["op"] == "bw":
        a, b = inputs[0], inputs[1]

        def dense_bw() -> float:
            ca, cb = a.T @ a, b.T @ b
            total = float(torch.trace(ca) + torch.trace(cb))
            return g.bures_wasserstein_sq_dense(ca, cb) / total

        return dense_bw
    if case["path"] == "lowrank":
        return lambda: gcwm_layer(inputs, weights, opts).conflict
    return lambda: gcwm_layer_dense(inputs, weights, opts)[1]


def run_case(case: dict[str, Any], iterations: int) -> dict[str, Any]:
    """In the child: warm up on a small case of the same kind, build inputs, reset, time once."""
    small = {**case, "width": 64, "rank": min(case["rank"], 8)}
    _operation(small, 1)()
    work = _operation(case, iterations)
    input_mb = (status_kb("VmRSS") or 0.0) / 1024
    device = torch.device("cpu")
    hwm_reset = start_window(device)
    start = time.perf_counter()
    value = work()
    seconds = time.perf_counter() - start
    peak, how = peak_mb(device, hwm_reset)
    return {
        **case,
        "seconds": round(seconds, 4),
        "peak_mb": round(peak, 1),
        "input_mb": round(input_mb, 1),
        "memory_measure": how,
        "value": float(value),
    }


def spawn(case: dict[str, Any], iterations: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", json.dumps(case), "--iterations", str(iterations)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {**case, "error": f"timeout after {timeout:.0f}s"}
    if done.returncode != 0:
        return {**case, "error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'op':5} {'path':8} {'d':>5} {'r':>3} {'T':>2} {'seconds':>9} {'peak MiB':>9}"
    head += f" {'input':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            where = f"{r['op']:5} {r['path']:8} {r['width']:>5} {r['rank']:>3} {r['tasks']:>2}"
            lines.append(f"{where} {r['error']}")
            continue
        lines.append(
            f"{r['op']:5} {r['path']:8} {r['width']:>5} {r['rank']:>3} {r['tasks']:>2} "
            f"{r['seconds']:>9.3f} {r['peak_mb']:>9.1f} {r['input_mb']:>7.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=3, help="Barycenter iterations (fixed).")
    parser.add_argument("--quick", action="store_true", help="Small widths, for a smoke run.")
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds per case.")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)), help="Update ranks.")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_case(json.loads(args.child), args.iterations)))
        return
    rows = []
    for case in plan(args.quick, tuple(int(r) for r in args.ranks.split(","))):
        rows.append(spawn(case, args.iterations, args.timeout))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    from forgetless.core.storage import atomic_write_json

    report = {
        "schema_version": 1,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "barycenter_iterations": args.iterations,
        "rows": rows,
    }
    atomic_write_json(args.out, report)
    print(table(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
