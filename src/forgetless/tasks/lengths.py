"""``train.max_length`` against the model and the data: a setting over the model's positions is
refused; an unset one becomes the longest example (at least 64), at most the model's positions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from forgetless.config.schema import SHORT_MAX_LENGTH
from forgetless.errors import ConfigError
from forgetless.tasks.base import Task
from forgetless.tasks.formatting import encoded_length


@dataclass(frozen=True)
class MaxLength:
    """The run's ``max_length`` and, when it was chosen from the data, the line that says why."""

    tokens: int
    chosen: str | None = None


def longest_example(tokenizer: Any, tasks: Sequence[Task]) -> int:
    """The most tokens any training or evaluation example of ``tasks`` takes, as trained."""
    return max(
        (encoded_length(tokenizer, e) for t in tasks for e in (*t.train, *t.eval)), default=0
    )


def check_max_length(configured: int, positions: int | None) -> None:
    """Refuse a ``train.max_length`` longer than the model can attend over."""
    if positions is not None and configured > positions:
        raise ConfigError(
            f"train.max_length={configured} is more than the model's {positions} positions "
            "(max_position_embeddings); lower it, or leave it unset to fit the data"
        )


def choose_max_length(longest: int, positions: int | None) -> MaxLength:
    """An unset ``max_length``: the longest example, at least ``SHORT_MAX_LENGTH`` (short data
    trains as before) and at most the model's positions."""
    floor = min(SHORT_MAX_LENGTH, positions) if positions is not None else SHORT_MAX_LENGTH
    allows = f"; model allows {positions}" if positions is not None else ""
    if longest <= floor:
        return MaxLength(
            floor, f"max_length: {floor} (longest example {longest}, raised to the least{allows})"
        )
    if positions is None or longest <= positions:
        return MaxLength(longest, f"max_length: {longest} (longest example{allows})")
    return MaxLength(
        positions,
        f"max_length: {positions} (the model's positions; the longest example has {longest} "
        "tokens, so longer ones are cut)",
    )


def fit_max_length(
    configured: int | None, tokenizer: Any, tasks: Sequence[Task], positions: int | None
) -> MaxLength:
    """The run's ``max_length``: the configured one once checked, else chosen from ``tasks``."""
    if configured is not None:
        check_max_length(configured, positions)
        return MaxLength(configured)
    return choose_max_length(longest_example(tokenizer, tasks), positions)
