"""``forgetless diagnose drift``: output-space KL of checkpoints against the first (the base) on
retention probes, beside each checkpoint's probe accuracy (``eval/generation.py``'s KL drift)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forgetless.diagnostics.diagnose_circuits import checkpoint_labels, load_checkpoint
from forgetless.errors import ConfigError
from forgetless.eval.generation import completion_logprobs, kl_drift
from forgetless.eval.scorers import score_task
from forgetless.tasks.base import Task


def probe_tasks(names: list[str], n: int, seed: int) -> list[Task]:
    """The built-in probes named; a name no built-in task has is one line naming --probes."""
    from forgetless.tasks.builtin import build_builtin_task, known_task_names, unknown_task

    if not names:
        raise ConfigError("--probes: names no probe; e.g. --probes copy,upper")
    for name in names:
        if name not in known_task_names():
            raise ConfigError(f"--probes: {unknown_task(name)}")
    return [build_builtin_task(name, 0, n, seed) for name in names]


def diagnose_drift(
    checkpoints: list[Path],
    probes: list[str],
    out: Path,
    n: int = 32,
    seed: int = 0,
    max_length: int = 64,
    batch_size: int = 64,
) -> dict[str, Any]:
    """Per checkpoint and probe: KL(p_base ‖ p_ckpt), KL(p_ckpt ‖ p_base) over the completion
    tokens of ``n`` probe examples (teacher-forced), and greedy exact-match accuracy."""
    from forgetless.core.ownership import check_output_file, write_output_file

    check_output_file(out, "drift", "drift.json")
    tasks = probe_tasks(probes, n, seed)
    base_logprobs: list[Any] = []
    rows = []
    for label, folder in zip(checkpoint_labels(checkpoints), checkpoints, strict=True):
        model, tokenizer = load_checkpoint(folder)
        row: dict[str, Any] = {"model": label, "probes": {}}
        for i, task in enumerate(tasks):
            now = completion_logprobs(model, tokenizer, task.eval, max_length)
            if len(base_logprobs) < len(tasks):
                base_logprobs.append(now)
            forward, reverse = kl_drift(base_logprobs[i], now)
            accuracy = score_task(model, tokenizer, task, batch_size).accuracy
            row["probes"][task.name] = {
                "kl_base_to_model": forward,
                "kl_model_to_base": reverse,
                "accuracy": accuracy,
            }
        values = list(row["probes"].values())
        for key in ("kl_base_to_model", "kl_model_to_base", "accuracy"):
            row[key] = sum(v[key] for v in values) / len(values)
        rows.append(row)
        del model
    data = {
        "schema_version": 1,
        "checkpoints": [str(c) for c in checkpoints],
        "probes": probes,
        "examples": n,
        "rows": rows,
    }
    write_output_file(out, "drift", data)
    return data
