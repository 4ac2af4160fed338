"""The task abstraction: examples in prompt/completion form plus a scorer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Message = dict[str, str]
Scorer = Callable[[str, str], bool]


def exact_match(prediction: str, reference: str) -> bool:
    """Exact match after stripping surrounding whitespace."""
    return prediction.strip() == reference.strip()


@dataclass(frozen=True)
class Example:
    """One supervised example.

    ``prompt`` is what the model sees, ``completion`` what it must produce. Chat data keeps the
    conversation in ``messages`` (the last one is the assistant answer, equal to ``completion``);
    the formatter then renders it with the tokenizer's chat template.
    """

    prompt: str
    completion: str
    messages: tuple[Message, ...] | None = None


@dataclass(frozen=True)
class Task:
    """A named task with train and eval splits and an exact-match style scorer."""

    name: str
    train: list[Example]
    eval: list[Example]
    description: str = ""
    scorer: Scorer = field(default=exact_match)
    max_new_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.eval:
            raise ValueError(f"task {self.name!r} has an empty eval split")
