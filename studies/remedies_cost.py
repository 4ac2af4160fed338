"""ASFT's and DFT's training step against ``seq_ft``'s on SmolLM2-135M-Instruct with LoRA.

The real track's settings (``--preset smollm2``, studies/configs/real.yaml): LoRA r 8 on the top
8 layers in the ``carry`` regime, batch 8 of ``it-json``, max length 96, float32. Each method runs
through the shared step loop on the same model (ASFT's reference is that model with its adapters
switched off, no second copy), at its documented defaults. Each repeat times ``--warmup`` then
``--steps`` steps of every method in turn, the order reversed every other repeat; a repeat's
figure is its median step, and each ratio is a method's over ``seq_ft``'s in the same repeat.
Reported: the medians over repeats, the ratios' median and range. Needs the model (``make
smollm2``); about 4 s a step on two free cores.

    python studies/remedies_cost.py [--repeats 5] [--steps 3] [--warmup 1]

``render_steps`` writes the table docs/remedies.md quotes (``render_tables.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
import torch
from peak_memory import timed_steps
from run_all import commit, load_words, machine, machine_words

from forgetless.config.loading import validate_config
from forgetless.config.presets import smollm2_config_dict
from forgetless.contract.hooks import RunInfo, TaskContext
from forgetless.contract.method import create_method, method_class
from forgetless.core.storage import atomic_write_json
from forgetless.engine.session import TaskSession
from forgetless.models.finetuner import Finetuner
from forgetless.models.loading import load_model_and_tokenizer
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import Features, encode_training_set

OUT = Path(__file__).parent / "results" / "remedies_smollm2_steps.json"
METHODS = ("seq_ft", "dft", "asft")
TASK = "it-json"


def _session(name: str, ctx: TaskContext, pad_id: int, work: Path) -> TaskSession:
    method = create_method(method_class(name).config_cls.model_validate({}))
    return TaskSession(method, ctx, pad_id, out_dir=work)


def _context(cfg: Any, model: Any, tokenizer: Any, features: list[Features]) -> TaskContext:
    info = RunInfo(
        cfg.seed,
        Path(tempfile.mkdtemp(prefix="forgetless-remedies-")),
        [TASK],
        [],
        cfg.finetune.mode,
        max_length=cfg.train.resolved_max_length,
        lora_regime=cfg.finetune.lora.regime,
    )
    task = build_builtin_task(TASK, n_train=len(features), n_eval=1, seed=0)
    device = next(model.parameters()).device
    return TaskContext(info, 1, task, model, tokenizer, features, [], device, [task])


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every repeat of every method: its step times and the window's peak memory."""
    cfg = validate_config(smollm2_config_dict())
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    finetuner = Finetuner(model, cfg.finetune)
    finetuner.begin_task(1)
    task = build_builtin_task(TASK, n_train=args.n_train, n_eval=1, seed=0)
    features, _ = encode_training_set(tokenizer, task.train, cfg.train.resolved_max_length, TASK)
    ctx = _context(cfg, finetuner.model, tokenizer, features)
    steps = argparse.Namespace(
        warmup=args.warmup, steps=args.steps, batch_size=cfg.train.batch_size
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in METHODS}
    for repeat in range(args.repeats):
        for name in METHODS if repeat % 2 == 0 else METHODS[::-1]:
            session = _session(name, ctx, tokenizer.pad_token_id, ctx.run.out_dir)
            with session.started():
                timing = timed_steps(session.loop(), features, steps)
            runs[name].append(timing)
            print(
                f"  {name} repeat {repeat + 1}/{args.repeats}: "
                f"{statistics.median(timing['times']):.2f} s/step",
                flush=True,
            )
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per method: its median step over repeats, and its per-repeat ratio to ``seq_ft``'s."""
    base = [statistics.median(r["times"]) for r in runs["seq_ft"]]
    rows = {}
    for name, records in runs.items():
        medians = [statistics.median(r["times"]) for r in records]
        ratios = [m / b for m, b in zip(medians, base, strict=True)]
        rows[name] = {
            "step_s": statistics.median(medians),
            "step_s_range": [min(medians), max(medians)],
            "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "peak_mb": statistics.median(r["peak_mb"] for r in records),
        }
    return rows


def render_steps(report: dict[str, Any]) -> str:
    """The table: each method's median step and its ratio to ``seq_ft``'s (range over repeats),
    then the machine and its load."""
    lines = ["| method | step, s (range) | step / `seq_ft` step (range) |", "|---|---|---|"]
    for name, row in report["rows"].items():
        low, high = row["step_s_range"]
        r_low, r_high = row["ratio_range"]
        lines.append(
            f"| `{name}` | {row['step_s']:.2f} ({low:.2f}–{high:.2f}) | "
            f"{row['ratio']:.2f}× ({r_low:.2f}–{r_high:.2f}) |"
        )
    s = report["settings"]
    lines.append(
        f"\n{s['repeats']} repeats of {s['warmup']} warm-up + {s['steps']} timed steps each, "
        f"interleaved; on {machine_words(report['machine'])}, "
        f"{load_words(report['load_average'])}."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    before = os.getloadavg()[0]
    runs = measure(args)
    report = {
        "model": "smollm2-135m-instruct",
        "task": TASK,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": summarize(runs),
        "runs": runs,
        "commit": commit(),
        "machine": machine(torch.get_num_threads()),
        "load_average": {"before": before, "after": os.getloadavg()[0]},
    }
    atomic_write_json(args.out, report)
    print(render_steps(report))


if __name__ == "__main__":
    main()
