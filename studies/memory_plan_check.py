"""The memory plan against measured peaks, as docs/performance.md quotes it (issue 50).

Each report in ``benchmarks/results/memory_plan/`` is a ``benchmarks/gpu_check.py`` run on the
CPU (one shape, checkpointing on or off), which this script starts and then stamps with where it
ran: the commit (and whether ``src/`` differed from it), the CPU, the torch threads and the
1-minute load average before and after. ``render_tables.py`` renders every report of the folder
as one table (``<!-- memory-plan-check: memory_plan -->``).

    OMP_NUM_THREADS=1 python studies/memory_plan_check.py builtin-off.json -- \\
        --shape builtin --batch-size 32 --length 64 ... --no-checkpointing
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "benchmarks" / "results"
SHAPE_LABELS = {
    "tiny": "dry-run tiny shape (Llama)",
    "builtin": "built-in tiny shape (Llama)",
    "smollm2": "SmolLM2-135M shape",
    "llama1b": "TinyLlama-1.1B shape",
}
"""``gpu_check.SHAPES`` by the model each stands for, in the table's order."""
HEADER = (
    "| model | batch | checkpointing | method | mode | weights | grads + AdamW | method state "
    "| activations | plan peak | measured | error |\n"
    "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
)


def plan_row(report: dict[str, Any], row: dict[str, Any]) -> str:
    """One measured case beside its plan, in MiB; the error is the plan's peak over the
    measured one, less 1 (negative: the plan falls short)."""
    s, plan = report["settings"], row["plan_mb"]
    cells = [
        SHAPE_LABELS[s["shape"]],
        f"B{s['batch_size']} × T{s['length']}",
        "on" if s["checkpointing"] else "off",
        f"`{row['method']}`",
        row["mode"],
        *(
            f"{v:.0f}"
            for v in (
                plan["weights"],
                plan["gradients"] + plan["optimizer"],
                plan["method_state"],
                plan["activations"],
                plan["peak"],
                row["peak_mb"],
            )
        ),
        f"{plan['peak'] / row['peak_mb'] - 1:+.1%}",
    ]
    return "| " + " | ".join(cells) + " |"


def _order(item: tuple[str, dict[str, Any]]) -> tuple[int, bool, str]:
    name, report = item
    s = report["settings"]
    return list(SHAPE_LABELS).index(s["shape"]), bool(s["checkpointing"]), name


def _measured(name: str, row: dict[str, Any]) -> dict[str, Any]:
    if "peak_mb" not in row:
        why = row.get("skipped") or row.get("error", "no peak")
        raise ValueError(f"{name}: case {row.get('case')} was not measured: {why}")
    return row


def render_reports(reports: dict[str, dict[str, Any]]) -> str:
    """The table of every report's method cases (by shape, checkpointing off first), then the
    line saying where and under what load they were measured."""
    ordered = sorted(reports.items(), key=_order)
    lines = [HEADER]
    for name, report in ordered:
        rows = [_measured(name, r) for r in report["rows"] if r.get("method") != "trl_sft"]
        lines += [plan_row(report, r) for r in rows if "plan_mb" in r]
    return "\n".join(lines) + "\n\n" + provenance(ordered) + "\n"


def provenance(ordered: list[tuple[str, dict[str, Any]]]) -> str:
    """Files, commit(s), CPU(s) and the 1-minute load average range of the reports."""

    def joined(values: list[str]) -> str:
        return ", ".join(dict.fromkeys(values))

    unstamped = [name for name, r in ordered if "provenance" not in r]
    if unstamped:
        raise ValueError(f"{', '.join(unstamped)}: not stamped (run through memory_plan_check.py)")
    stamps = [r["provenance"] for _, r in ordered]
    commits = joined([p["commit"][:7] for p in stamps])
    if any(p["src_dirty"] for p in stamps):
        commits += " with uncommitted changes to `src/`"
    cpus = [
        f"{p['cpu']} ({p['cores']} cores, {p['torch_threads']} torch thread(s))" for p in stamps
    ]
    before = [p["load_average"]["before"] for p in stamps]
    after = [p["load_average"]["after"] for p in stamps]
    return (
        f"Reports {joined([f'`{n}`' for n, _ in ordered])}: commit {commits}, on "
        f"{joined(cpus)}; 1-minute load average {min(before):.1f}–{max(before):.1f} before a "
        f"run, {min(after):.1f}–{max(after):.1f} after."
    )


def render_folder(folder: str) -> str:
    """Every JSON report of ``benchmarks/results/<folder>/`` as one table."""
    paths = sorted((REPORTS / folder).glob("*.json"))
    if not paths:
        return f"Not measured yet: no report in `benchmarks/results/{folder}/`.\n"
    return render_reports({p.name: json.loads(p.read_text(encoding="utf-8")) for p in paths})


def stamp() -> dict[str, Any]:
    """Where this process runs: commit, whether ``src/`` differs from it, CPU, threads, load."""
    import torch

    from forgetless.core.machine import cpu_name

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    return {
        "commit": git("rev-parse", "HEAD").strip(),
        "src_dirty": bool(git("status", "--porcelain", "--", "src").strip()),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": {"before": os.getloadavg()[0]},
    }


def main(argv: list[str]) -> None:
    """Run ``gpu_check.py`` with the arguments after ``--`` into the folder's ``NAME``, then
    stamp the report with where it ran."""
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit("usage: memory_plan_check.py NAME.json -- GPU_CHECK_ARGS...")
    out = REPORTS / "memory_plan" / argv[0]
    partial = out.with_suffix(".partial")  # not a report until stamped: the table skips it
    provenance_ = stamp()
    script = ROOT / "benchmarks" / "gpu_check.py"
    subprocess.run([sys.executable, str(script), *argv[2:], "--out", str(partial)], check=True)
    provenance_["load_average"]["after"] = os.getloadavg()[0]
    report = json.loads(partial.read_text(encoding="utf-8"))
    report["provenance"] = provenance_
    report["settings"].pop("config_dir", None)  # a temporary folder, different every run
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    partial.unlink()


if __name__ == "__main__":
    main(sys.argv[1:])
