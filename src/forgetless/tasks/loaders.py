"""Tasks from the built-in suite, JSONL files, or Hugging Face ``datasets``."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from forgetless.config.schema import (
    DEFAULT_EVAL_FRACTION,
    Columns,
    EvalConfig,
    HFSource,
    JsonlSource,
    TaskConfig,
)
from forgetless.core import hub
from forgetless.errors import DataError
from forgetless.tasks.base import Example, Task
from forgetless.tasks.builtin import build_builtin_task, known_task_names, unknown_task

ROLES = {"system", "user", "assistant"}


def example_from_record(record: Any, where: str, columns: Columns, hint: str = "") -> Example:
    """Build an Example from a prompt/completion record or a chat ``messages`` record.

    A record with a choices column (a list of strings) and a label column (the index of the
    right choice) is a multiple-choice example; its completion defaults to the right choice.
    A missing column is one line naming the columns the record has (and ``hint``: where to map
    other names).
    """
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected an object, got {type(record).__name__}")
    if record.get(columns.choices) is not None:
        return _choice_example(record, where, columns, hint)
    messages = record.get(columns.messages)
    if messages is not None:
        return _chat_example(messages, where)
    prompt = _text(record, columns.prompt, where, hint)
    return Example(prompt=prompt, completion=_text(record, columns.completion, where, hint))


def _text(record: Mapping[str, Any], column: str, where: str, hint: str) -> str:
    value = record.get(column)
    if isinstance(value, str):
        return value
    if column not in record:
        found = _column_names(record)
        raise DataError(f"{where}: no column {column!r}; found: {found}{hint}")
    raise DataError(f"{where}: column {column!r} holds {type(value).__name__}, not text")


SHOWN_COLUMNS = 12


def _column_names(record: Mapping[str, Any]) -> str:
    """The record's column names for an error line: the first few, each on one line."""
    names = [" ".join(str(k).split())[:40] for k in list(record)[:SHOWN_COLUMNS]]
    more = ", ..." if len(record) > SHOWN_COLUMNS else ""
    return ", ".join(names) + more if names else "none"


def _choice_example(record: Mapping[str, Any], where: str, columns: Columns, hint: str) -> Example:
    choices_col, label_col = columns.choices, columns.label
    choices, label = record[choices_col], record.get(label_col)
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
    prompt = _text(record, columns.prompt, where, hint)
    completion = record.get(columns.completion)
    if not isinstance(completion, str):
        completion = choices[label]
    return Example(prompt=prompt, completion=completion, choices=tuple(choices), label=label)


def _message_fault(index: int, message: Any) -> str | None:
    """What is wrong with one chat message, or None."""
    if not isinstance(message, Mapping):
        return f"message {index} is a {type(message).__name__}, not a {{role, content}} object"
    if message.get("role") not in ROLES:
        roles = ", ".join(sorted(ROLES))
        return f"message {index} has role {message.get('role')!r}; roles are {roles}"
    if not isinstance(message.get("content"), str):
        return f"message {index}'s content is not text"
    return None


def _chat_example(messages: Any, where: str) -> Example:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    fault = next(filter(None, (_message_fault(i, m) for i, m in enumerate(messages))), None)
    if fault:
        raise DataError(f"{where}: {fault}")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's answer")
    turns = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    prompt = next((m["content"] for m in reversed(turns[:-1]) if m["role"] == "user"), "")
    return Example(prompt=prompt, completion=turns[-1]["content"], messages=turns)


JSONL_HINT = " (map them with columns: {prompt: ..., completion: ...})"


def read_jsonl(path: Path, columns: Columns | None = None) -> list[Example]:
    """Read examples from JSONL; a broken line is a DataError naming file and line number."""
    columns = columns or Columns()
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
            examples.append(example_from_record(record, where, columns, JSONL_HINT))
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


def _split(
    examples: list[Example], fraction: float, seed: int, where: str
) -> tuple[list[Example], list[Example]]:
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(examples) * fraction))
    if n_eval >= len(examples):
        raise DataError(
            f"{where}: {len(examples)} example(s), too few to split off an eval set (give more, "
            "or an eval file or split of their own)"
        )
    eval_idx = set(order[:n_eval])
    return [e for i, e in enumerate(examples) if i not in eval_idx], [
        examples[i] for i in order[:n_eval]
    ]


def _held_out(
    examples: list[Example], fraction: float | None, seed: int, probe: bool, where: str
) -> tuple[list[Example], list[Example]]:
    """A probe's examples are all evaluated unless a fraction is asked for; a task's are split."""
    if probe and fraction is None:
        return [], examples
    return _split(examples, fraction or DEFAULT_EVAL_FRACTION, seed, where)


def _jsonl_splits(src: JsonlSource, seed: int, probe: bool) -> tuple[list[Example], list[Example]]:
    train = read_jsonl(src.train, src.columns)
    if src.eval is not None:
        return train, read_jsonl(src.eval, src.columns)
    return _held_out(train, src.eval_fraction, seed, probe, str(src.train))


COMMON_BUILDERS = ("arrow", "csv", "json", "pandas", "parquet", "text")


def _meant_local(path: str) -> bool:
    """A path written as a local one: from the root, home or here, or under a folder here."""
    parts = Path(path).parts
    return path.startswith(("/", "./", "../", "~")) or (len(parts) > 1 and Path(parts[0]).is_dir())


def _hub_dataset(path: str) -> bool:
    """Whether ``load_dataset(path)`` would ask the hub: not a builder, not a local path."""
    from datasets import packaged_modules

    builders = getattr(packaged_modules, "_PACKAGED_DATASETS_MODULES", COMMON_BUILDERS)
    local = Path(path).expanduser().exists() or _meant_local(path)
    return path not in builders and not local


def reads_local_files(cfg: TaskConfig) -> bool:
    """Whether building the task reads local files only: a JSONL source, or a dataset that is a
    local folder or a builder over local files (not a hub id)."""
    return cfg.jsonl is not None or (cfg.hf is not None and not _hub_dataset(cfg.hf.path))


@contextmanager
def _no_progress_bars(quiet: bool) -> Iterator[None]:
    """datasets' bars off while ``quiet`` (a local read: "Generating train split" is noise on
    the error stream; a hub download keeps its bar)."""
    import datasets

    was_on = datasets.is_progress_bar_enabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if quiet and was_on:
            datasets.enable_progress_bars()


def check_reachable(src: HFSource) -> None:
    """A hub dataset that cannot be downloaded now and is not cached: refused at once."""
    if not _hub_dataset(src.path):
        return
    why = hub.why_unreachable(datasets=True)
    if why is not None and not hub.dataset_cached(src.path):
        raise DataError(hub.not_cached(f"dataset {src.path!r}", why))


def _load_hf_split(src: HFSource, split: str) -> Iterable[Mapping[str, Any]]:
    import datasets

    check_reachable(src)
    if _meant_local(src.path) and not Path(src.path).expanduser().exists():
        raise DataError(f"dataset {src.path!r}: no such folder")
    try:
        with _no_progress_bars(not _hub_dataset(src.path)):
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


HF_HINT = " (name others with prompt_column and completion_column)"


def _hf_columns(src: HFSource) -> Columns:
    return Columns(
        prompt=src.prompt_column,
        completion=src.completion_column,
        messages=src.messages_column or "messages",
        choices=src.choices_column or "choices",
        label=src.label_column or "label",
    )


def _hf_splits(src: HFSource, seed: int, probe: bool) -> tuple[list[Example], list[Example]]:
    columns = _hf_columns(src)

    def convert(split: str) -> list[Example]:
        rows = _load_hf_split(src, split)
        return [
            example_from_record(r, f"{src.path}[{split}][{i}]", columns, HF_HINT)
            for i, r in enumerate(rows)
        ]

    train = convert(src.train_split)
    if src.eval_split is not None:
        return train, convert(src.eval_split)
    where = f"dataset {src.path!r} split {src.train_split!r}"
    return _held_out(train, src.eval_fraction, seed, probe, where)


USER_MAX_NEW_TOKENS = 64
"""The generation budget of a JSONL or Hugging Face task that sets no ``max_new_tokens``."""


def build_task(cfg: TaskConfig, eval_cfg: EvalConfig, seed: int, probe: bool = False) -> Task:
    """Materialise one configured task with its caps on train and eval sizes; a ``probe``'s
    file (or split) is all evaluation unless the config asks for a split."""
    n_eval = cfg.n_eval or eval_cfg.n_eval
    n_train = cfg.n_train or eval_cfg.n_train
    if cfg.builtin is not None:
        if cfg.builtin not in known_task_names():
            raise DataError(unknown_task(cfg.builtin))
        task = build_builtin_task(cfg.builtin, n_train=n_train, n_eval=n_eval, seed=seed)
        train, evals, desc, budget = task.train, task.eval, task.description, task.max_new_tokens
        scoring = task.scoring
    else:
        train, evals = (
            _jsonl_splits(cfg.jsonl, seed, probe) if cfg.jsonl else _hf_splits(cfg.hf, seed, probe)  # type: ignore[arg-type]
        )
        desc, budget, scoring = "user data", USER_MAX_NEW_TOKENS, None
    try:
        return Task(
            name=cfg.display_name,
            train=train[:n_train],
            eval=evals[:n_eval],
            description=desc,
            max_new_tokens=cfg.max_new_tokens or budget,
            scoring=cfg.scorer or scoring,
            source_rows=0 if cfg.builtin is not None else len(train),
        )
    except ValueError as err:
        raise DataError(str(err)) from None
