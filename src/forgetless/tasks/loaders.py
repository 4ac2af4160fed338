"""Tasks from the built-in suite, JSONL files, or Hugging Face ``datasets``."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from forgetless.config.schema import EvalConfig, HFSource, JsonlSource, TaskConfig
from forgetless.errors import DataError
from forgetless.tasks.base import Example, Task
from forgetless.tasks.builtin import build_builtin_task, known_task_names

ROLES = {"system", "user", "assistant"}


def example_from_record(
    record: Any,
    where: str,
    columns: tuple[str, str, str | None],
    choice_columns: tuple[str, str] = ("choices", "label"),
) -> Example:
    """Build an Example from a prompt/completion record or a chat ``messages`` record.

    A record with a choices column (a list of strings) and a label column (the index of the
    right choice) is a multiple-choice example; its completion defaults to the right choice.
    """
    prompt_col, completion_col, messages_col = columns
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected an object, got {type(record).__name__}")
    if record.get(choice_columns[0]) is not None:
        return _choice_example(record, where, prompt_col, completion_col, choice_columns)
    messages = record.get(messages_col or "messages")
    if messages is not None:
        return _chat_example(messages, where)
    prompt, completion = record.get(prompt_col), record.get(completion_col)
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DataError(
            f"{where}: needs string fields {prompt_col!r} and {completion_col!r} (or 'messages')"
        )
    return Example(prompt=prompt, completion=completion)


def _choice_example(
    record: Mapping[str, Any],
    where: str,
    prompt_col: str,
    completion_col: str,
    choice_columns: tuple[str, str],
) -> Example:
    choices_col, label_col = choice_columns
    choices, label, prompt = record[choices_col], record.get(label_col), record.get(prompt_col)
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) for c in choices)
    ):
        raise DataError(f"{where}: {choices_col!r} must be a list of at least 2 strings")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise DataError(
            f"{where}: {label_col!r} must be the index of the right choice (0..{len(choices) - 1})"
        )
    if not isinstance(prompt, str):
        raise DataError(f"{where}: needs a string field {prompt_col!r}")
    completion = record.get(completion_col)
    if not isinstance(completion, str):
        completion = choices[label]
    return Example(prompt=prompt, completion=completion, choices=tuple(choices), label=label)


def _chat_example(messages: Any, where: str) -> Example:
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, Mapping) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok:
        raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's answer")
    turns = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    prompt = next((m["content"] for m in reversed(turns[:-1]) if m["role"] == "user"), "")
    return Example(prompt=prompt, completion=turns[-1]["content"], messages=turns)


def read_jsonl(
    path: Path, columns: tuple[str, str, str | None] = ("prompt", "completion", None)
) -> list[Example]:
    """Read examples from JSONL; a broken line is a DataError naming file and line number."""
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    examples = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{where}: not UTF-8 text (byte {err.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{where}: invalid JSON ({err.msg} at column {err.colno})"
                ) from None
            except (ValueError, RecursionError) as err:  # e.g. a 5000-digit number, deep nesting
                raise DataError(f"{where}: invalid JSON ({type(err).__name__})") from None
            examples.append(example_from_record(record, where, columns))
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


def _split(
    examples: list[Example], fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(examples) * fraction))
    if n_eval >= len(examples):
        raise DataError(f"only {len(examples)} examples: too few to split off an eval set")
    eval_idx = set(order[:n_eval])
    return [e for i, e in enumerate(examples) if i not in eval_idx], [
        examples[i] for i in order[:n_eval]
    ]


def _jsonl_splits(src: JsonlSource, seed: int) -> tuple[list[Example], list[Example]]:
    train = read_jsonl(src.train)
    if src.eval is not None:
        return train, read_jsonl(src.eval)
    return _split(train, src.eval_fraction, seed)


def _load_hf_split(src: HFSource, split: str) -> Iterable[Mapping[str, Any]]:
    import datasets

    try:
        local = Path(src.path)
        if (local / "dataset_dict.json").is_file() or (local / "state.json").is_file():
            loaded = datasets.load_from_disk(str(local))
            return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        return datasets.load_dataset(src.path, src.name, data_files=src.data_files, split=split)
    except (
        OSError,  # FileNotFoundError, and ConnectionError for a hub id while offline
        ValueError,
        KeyError,
        datasets.exceptions.DatasetNotFoundError,
    ) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"dataset {src.path!r} split {split!r}: {first}") from None


def _hf_splits(src: HFSource, seed: int) -> tuple[list[Example], list[Example]]:
    columns = (src.prompt_column, src.completion_column, src.messages_column)
    choice_columns = (src.choices_column or "choices", src.label_column or "label")

    def convert(split: str) -> list[Example]:
        rows = _load_hf_split(src, split)
        return [
            example_from_record(r, f"{src.path}[{split}][{i}]", columns, choice_columns)
            for i, r in enumerate(rows)
        ]

    train = convert(src.train_split)
    if src.eval_split is not None:
        return train, convert(src.eval_split)
    return _split(train, src.eval_fraction, seed)


def build_task(cfg: TaskConfig, eval_cfg: EvalConfig, seed: int) -> Task:
    """Materialise one configured task with its caps on train and eval sizes."""
    n_eval = cfg.n_eval or eval_cfg.n_eval
    n_train = cfg.n_train or eval_cfg.n_train
    if cfg.builtin is not None:
        if cfg.builtin not in known_task_names():
            known = ", ".join(known_task_names())
            raise DataError(f"unknown built-in task {cfg.builtin!r}; known: {known}")
        task = build_builtin_task(cfg.builtin, n_train=n_train, n_eval=n_eval, seed=seed)
        train, evals, desc, budget = task.train, task.eval, task.description, task.max_new_tokens
        scoring = task.scoring
    else:
        train, evals = _jsonl_splits(cfg.jsonl, seed) if cfg.jsonl else _hf_splits(cfg.hf, seed)  # type: ignore[arg-type]
        desc, budget, scoring = "user data", 64, None
    try:
        return Task(
            name=cfg.display_name,
            train=train[:n_train],
            eval=evals[:n_eval],
            description=desc,
            max_new_tokens=cfg.max_new_tokens or budget,
            scoring=cfg.scorer or scoring,
        )
    except ValueError as err:
        raise DataError(str(err)) from None
