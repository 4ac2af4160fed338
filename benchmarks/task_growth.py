"""How each method's step cost grows with the number of past tasks: the 2nd, 4th and 8th task.

One process per method and repeat (forked after the imports): the method's state is built over
past tasks of a few steps each (``method_harness``), and the steps of the next task are timed
after 1, 3 and 7 past tasks (``--points``), in that order in the same process (the timed task
then joins the past). Full fine-tuning, O-LoRA with its ``per_task`` adapters.

Side by side in the same process, a stateless ``seq_ft`` model (``method_harness.Control``) runs
``--control-steps`` steps on the timed task's data just before and just after that task. The
tasks' lengths differ, and a process's steps slow down as it ages whatever the method, so a row's
``step_growth`` at P past tasks is its median step over the control's median at P, divided by
the same ratio at the first point; ``raw_step_growth`` leaves the control out, and
``control_drift`` is the control's own change. ``task_growth`` does the same for the whole
stage per plan step. The methods alternate order over ``--repeats``; medians over repeats.
``width_growth`` is the same ratio of padded tokens per training forward: replay's memory and
SAE-FD's anchors put past tasks' samples in the batch, and a longer past task pads it wider.
``grows`` marks a row whose step growth at the last point exceeds 1 by more than
``--tolerance``. No method is exempt by name: a growing row needs a measured cause, either the
padded width (the step per padded token within the tolerance) or a line through its growth
against the past tasks that fits every point within the tolerance, which bounds it.

Run: ``python benchmarks/task_growth.py [--steps 30] [--repeats 2]``; the report goes to
``benchmarks/results/task_growth.json``. Quick check: ``python benchmarks/task_growth.py --steps 2
--warmup 1 --repeats 1 --n-train 32 --control-steps 2 --methods replay --points 1,2 --out
/tmp/tg.json``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
from method_harness import (  # benchmarks/ is on sys.path
    EXCLUDED,
    add_harness_args,
    alternated,
    measure,
    median_of,
    methods,
    supports,
)
from peak_memory import add_step_args, run_forked

from forgetless.core.storage import atomic_write_json

OUT = Path(__file__).parent / "results" / "task_growth.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(parser, OUT)
    add_harness_args(parser)
    parser.add_argument("--methods", default="all", help="comma-separated, or all")
    parser.add_argument("--points", default="1,3,7", help="past tasks before each timed task")
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument(
        "--control-steps", type=int, default=10, help="control steps before and after each task"
    )
    parser.set_defaults(steps=30, repeats=2)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    points = [int(p) for p in args.points.split(",")]
    names = methods() if args.methods == "all" else ["seq_ft", *args.methods.split(",")]
    cases = [(n, "full" if supports(n, "full") else "lora") for n in dict.fromkeys(names)]

    def run(name: str, mode: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = run_forked(measure, name, mode, args, points, True)
        return rows

    runs = alternated(cases, args.repeats, run)
    rows = [row for case, rs in runs.items() if (row := growth(case, rs, args)) is not None]
    report = {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "excluded": {**EXCLUDED, "mtl": "joint training on the first task: no past tasks"},
        "rows": rows,
        "runs": {f"{n}/{m}": rs for (n, m), rs in runs.items()},
    }
    atomic_write_json(args.out, report)
    for row in rows:
        steps = " ".join(f"{p['tasks']}:x{p['step_growth']:.2f}" for p in row["points"])
        print(f"{row['method']:17s} {row['mode']:4s} step {steps} grows={row['grows']}")
    print(f"report: {args.out}")


def growth(
    case: tuple[str, str],
    repeats: list[list[dict[str, Any]]],
    args: argparse.Namespace,
) -> dict[str, Any] | None:
    """One method's growth curve (None for a method timed on its first task only)."""
    if len(repeats[0]) < 2:
        return None

    def at(rs: list[list[dict[str, Any]]], i: int, key: str) -> float:
        return median_of([r[i] for r in rs], key)

    def ratio(i: int, key: str, control: str = "control_step_s") -> float:
        """Median over repeats of (method / control at point i) / (the same at the first)."""
        return statistics.median(
            (r[i][key] / r[i][control]) / (r[0][key] / r[0][control]) for r in repeats
        )

    points = []
    for i, first in enumerate(repeats[0]):
        points.append(
            {
                "tasks": first["task_index"],
                "past_tasks": first["past_tasks"],
                "step_s": at(repeats, i, "step_s"),
                "control_step_s": at(repeats, i, "control_step_s"),
                "step_growth": round(ratio(i, "step_s"), 3),
                "task_growth": round(ratio(i, "task_s_per_step"), 3),
                "raw_step_growth": round(at(repeats, i, "step_s") / at(repeats, 0, "step_s"), 3),
                "control_drift": round(
                    at(repeats, i, "control_step_s") / at(repeats, 0, "control_step_s"), 3
                ),
                "width_growth": round(
                    ratio(i, "tokens_per_forward", "control_tokens_per_forward"), 3
                ),
                "state_bytes": first["state_bytes"],
            }
        )
    last = points[-1]
    grows = last["step_growth"] > 1 + args.tolerance
    name = case[0]
    why = (
        (_width_why(last, args.tolerance) or _linear_why(points, args.tolerance)) if grows else None
    )
    return {
        "method": name,
        "mode": case[1],
        "points": points,
        "grows": grows,
        "task_grows": last["task_growth"] > 1 + args.tolerance,
        **({"why": why} if why else {}),
    }


def _width_why(last: dict[str, Any], tolerance: float) -> str | None:
    """The reason of a step that grows only as much as its batch's padded width (or None)."""
    width, step = last["width_growth"], last["step_growth"]
    if width <= 1.0 or step / width > 1 + tolerance:
        return None
    return (
        f"its batches draw samples of past tasks, whose lengths pad them wider: ×{width:.2f} "
        f"padded tokens per forward, ×{step / width:.2f} per token (measured, not the count "
        "of past tasks: a fixed number of samples per step)"
    )


def _linear_why(points: list[dict[str, Any]], tolerance: float) -> str | None:
    """A measured bound for a step that grows with the past tasks themselves: a least-squares
    line through the step growth against the number of past tasks, accepted only when every
    point lies within ``tolerance`` of it (else the growth has no cause measured here)."""
    xs = [float(p["past_tasks"]) for p in points]
    ys = [float(p["step_growth"]) for p in points]
    if len(xs) < 3:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    worst = max(abs(y - (my + slope * (x - mx))) for x, y in zip(xs, ys, strict=True))
    if worst > tolerance:
        return None
    return (
        f"linear in the past tasks: ×{slope:+.3f} of the first task's step per past task "
        f"(least squares over {len(xs)} points, largest residual {worst:.3f}); bound at T "
        f"tasks: ≤ {ys[0] - slope * xs[0]:.2f} + {slope:.3f}·(T − 1) + {tolerance:g}"
    )


if __name__ == "__main__":
    main()
