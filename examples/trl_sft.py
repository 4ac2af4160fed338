"""A TRL SFTTrainer script, taught two tasks in a row, with EWC added through
forgetless.integrations (the lines marked ``# forgetless``), against the same script without it.

    python examples/trl_sft.py            # about a minute on two CPU cores

The model is forgetless's shipped tiny base (a 1.0M-parameter Qwen2 that knows copy and upper
and, in its own format, the skills the tasks teach in a new one; docs/tiny-suite.md). Each task
is a prompt/completion dataset that SFTTrainer tokenizes itself. After each task the script
scores both tasks and two probes (exact match, greedy decoding), prints the accuracy matrix, and
the retention of task 1 and of the probes; with EWC, the trainer's log also carries
``forgetless/ewc``, ``forgetless/retention`` and ``forgetless/kl_to_base`` (docs/integrations.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import datasets
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging
from trl import SFTConfig, SFTTrainer

import forgetless
from forgetless.config.schema import EvalConfig
from forgetless.eval.evaluator import EvalRow, Evaluator
from forgetless.integrations import with_method  # forgetless
from forgetless.models.tiny import build_char_tokenizer
from forgetless.tasks.builtin import build_builtin_task

BASE = Path(forgetless.__file__).parent / "assets" / "tiny-base"
TASKS = ("reverse", "cipher")
PROBES = ("copy", "upper")


def sft_sequence(method: str | None, steps: int, seed: int, out: Path) -> list[EvalRow]:
    """Train the tasks in order with SFTTrainer (and ``method``); the evaluation rows: the
    base, then one after each task."""
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(BASE))
    tasks = [build_builtin_task(n, n_train=512, n_eval=64, seed=seed) for n in TASKS]
    probes = [build_builtin_task(n, n_train=64, n_eval=64, seed=seed) for n in PROBES]
    evaluator = Evaluator(
        probes, tokenizer, tasks=tasks, max_length=64,
        settings=EvalConfig(batch_size=64, kl_examples=32, loglik_examples=0, prose=False),
    )  # fmt: skip
    evaluator.measure_base(model, score=True)
    assert evaluator.base_row is not None
    rows = [evaluator.base_row]
    config = SFTConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=16,
        learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.0, seed=seed,
        max_length=64, bf16=False, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=steps // 2, disable_tqdm=True,
    )  # fmt: skip
    trainer_cls: Any = SFTTrainer
    if method is not None:  # forgetless
        trainer_cls = with_method(SFTTrainer, method, lam=5e3, probes=list(PROBES))  # forgetless
    for task in tasks:
        data = Dataset.from_list(
            [{"prompt": e.prompt, "completion": e.completion} for e in task.train]
        )
        # a new trainer of the same class is the next task: the method's state carries over
        trainer = trainer_cls(
            model=model, args=config, train_dataset=data, processing_class=tokenizer
        )
        trainer.train()
        rows.append(evaluator.score(model))
    return rows


def show(label: str, rows: list[EvalRow]) -> None:
    names = [*TASKS, *PROBES]
    print(f"\n{label}: accuracy (rows: base, after each task; columns: tasks, then probes)")
    print(" " * 14 + "".join(f"{n:>9}" for n in names))
    for row_name, row in zip(["base", *(f"after {t}" for t in TASKS)], rows, strict=True):
        print(f"{row_name:<14}" + "".join(f"{row.accuracy[n]:9.2f}" for n in names))
    kept = rows[-1].retention(rows[0])
    learned, last = rows[1].accuracy[TASKS[0]], rows[-1].accuracy[TASKS[0]]
    print(f"task 1 ({TASKS[0]}): {learned:.2f} when learned, {last:.2f} at the end")
    print("probe retention: " + ", ".join(f"{n} {k.retention or 0:.2f}" for n, k in kept.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per task")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        plain = sft_sequence(None, options.steps, options.seed, Path(out) / "plain")
        ewc = sft_sequence("ewc", options.steps, options.seed, Path(out) / "ewc")
    show("SFTTrainer", plain)
    show("SFTTrainer + EWC (forgetless.integrations)", ewc)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
