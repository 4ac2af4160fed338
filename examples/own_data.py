"""Your own model and data, no YAML: ``ContinualTrainer`` on three in-memory datasets, one of
them in chat ``messages`` form, then the accuracy matrix and what the model kept.

    python examples/own_data.py            # about a minute on two CPU cores

The model is forgetless's shipped tiny base (a 1.0M-parameter Qwen2 that knows copy and upper;
docs/tiny-suite.md); the three tasks are built in memory as ``datasets.Dataset`` objects.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from datasets import Dataset
from rich.console import Console

import forgetless
from forgetless.config.schema import ModelConfig
from forgetless.models.loading import load_model_and_tokenizer
from forgetless.report.table import accuracy_table, metrics_table
from forgetless.tasks.builtin import build_builtin_task
from forgetless.training.pretrain import shipped_base_dir


def records(skill: str, n: int) -> list[dict[str, Any]]:
    """Prompt/completion records of one of the built-in skills (any list of dicts will do)."""
    task = build_builtin_task(skill, n_train=n, n_eval=1, seed=0)
    return [{"prompt": e.prompt, "completion": e.completion} for e in task.train]


def chat(skill: str, n: int) -> list[dict[str, Any]]:
    """The same as chat turns: a user message and the assistant's answer."""
    return [
        {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["completion"]},
            ]
        }
        for r in records(skill, n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="run folder (default: a temporary one)")
    parser.add_argument("--method", default="ewc", help="a method name (forgetless methods)")
    args = parser.parse_args()
    base = shipped_base_dir(ModelConfig())
    assert base is not None, "the shipped tiny base is missing from the package"
    # any transformers model and tokenizer will do; this one is loaded as forgetless loads it
    model, tokenizer = load_model_and_tokenizer(ModelConfig(), str(base))
    tasks = [
        ("reverse", Dataset.from_list(records("reverse", 200))),
        ("cipher", Dataset.from_list(records("cipher", 200))),
        ("sort-chat", Dataset.from_list(chat("sort", 200))),
    ]
    out = args.out or Path(tempfile.mkdtemp(prefix="forgetless-own-data-")) / "run"
    start = time.perf_counter()
    trainer = forgetless.ContinualTrainer(
        model,
        tokenizer,
        tasks,
        method=args.method,
        probes=["copy", "upper"],
        out_dir=out,
        progress=False,
        steps=80,
        batch_size=16,
        lr=3e-3,
        max_length=48,
        evaluation={"n_eval": 32, "batch_size": 32},
    )
    data = trainer.fit().to_json()
    console = Console()
    console.print(accuracy_table(data))
    console.print(metrics_table(data))
    console.print(f"{args.method}: {time.perf_counter() - start:.0f} s; run folder {out}")


if __name__ == "__main__":
    main()
