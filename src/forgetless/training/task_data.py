"""A run's tasks: built from their configs, and encoded up front so that a bad example fails
before any training (truncation and unknown tokens said once per task and recorded)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from forgetless.config.schema import RunConfig, TaskConfig
from forgetless.engine.progress import Heartbeat
from forgetless.errors import ForgetlessError
from forgetless.tasks.base import Task
from forgetless.tasks.formatting import Features, encode_training_set, unknown_token_examples
from forgetless.tasks.loaders import build_task
from forgetless.training.results import Results

Say = Callable[[str], None]


def load_tasks(
    configs: list[TaskConfig], cfg: RunConfig, say: Say | None = None, probes: bool = False
) -> list[Task]:
    """Build every task (``probes``: as probes, a file all evaluation unless split); with
    ``say``, a long build prints a progress line now and then."""
    heartbeat = Heartbeat(say or (lambda line: None), "building tasks", len(configs))
    section = "probes" if probes else "tasks"
    where = {id(entry): i for i, entry in enumerate(cfg.probes if probes else cfg.tasks)}
    tasks = []
    for index, config in enumerate(configs):
        # its place in the run's config (a list that is not the config's own: as given)
        place = f"{section}.{where.get(id(config), index)}"
        try:
            task = build_task(config, cfg.eval, cfg.seed, probes)
        except ForgetlessError as err:
            raise type(err)(f"{place}: {err}") from None
        note = None if probes else cap_note(task, config, place)
        if note and say:
            say(note)
        tasks.append(task)
        heartbeat.beat()
    return tasks


def cap_note(task: Task, config: TaskConfig, place: str) -> str | None:
    """One line when ``eval.n_train`` left rows of a file or dataset out of training: a task
    that sets its own ``n_train`` asked for its cap, so it is not told."""
    if config.n_train is not None or task.source_rows <= len(task.train):
        return None
    return (
        f"note: task {task.name!r} trains on the first {len(task.train)} of its "
        f"{task.source_rows} rows (eval.n_train caps a task without its own n_train: raise it, "
        f"or set {place}.n_train)"
    )


def encode_task(task: Task, tokenizer: Any, max_length: int) -> list[Features]:
    features, _ = encode_training_set(tokenizer, task.train, max_length, f"task {task.name!r}")
    return features


def encode_remaining(
    tasks: list[Task], tokenizer: Any, max_length: int, results: Results, say: Say
) -> dict[int, list[Features]]:
    """Encode the tasks still to train up front, so a bad example fails before any training.

    Truncation is counted, warned about once per task and recorded in ``events`` (policy in
    docs/reliability.md). Only the next task's features are kept (memory stays one task's);
    later tasks are encoded again when they start.
    """
    out = {}
    remaining = range(results.completed_tasks + 1, len(tasks) + 1)
    heartbeat = Heartbeat(say, "encoding tasks", len(remaining))
    for index in remaining:
        heartbeat.beat()
        task = tasks[index - 1]
        features, cut = encode_training_set(
            tokenizer, task.train, max_length, f"task {task.name!r}"
        )
        if cut:
            say(
                f"warning: task {task.name!r}: {cut} of {len(features)} training examples "
                f"exceed train.max_length={max_length} tokens; their completions are cut "
                "at the end"
            )
            event = {
                "type": "truncated",
                "task": task.name,
                "count": cut,
                "of": len(features),
                "max_length": max_length,
            }
            _record_once(results, event)
        _warn_unknown(task.name, features, tokenizer, results, say)
        if index == results.completed_tasks + 1:
            out[index] = features
    return out


def _warn_unknown(
    task: str, features: list[Features], tokenizer: Any, results: Results, say: Say
) -> None:
    """Examples the tokenizer cannot spell are trained on ``<unk>``: say so, never silently."""
    count = unknown_token_examples(tokenizer, features)
    if not count:
        return
    say(
        f"warning: task {task!r}: {count} of {len(features)} training examples hold text the "
        "tokenizer cannot spell (it becomes the unknown token)"
    )
    _record_once(
        results, {"type": "unknown_tokens", "task": task, "count": count, "of": len(features)}
    )


def _record_once(results: Results, event: dict[str, object]) -> None:
    if event not in results.events:
        results.events.append(event)
