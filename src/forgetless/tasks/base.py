"""The task abstraction: examples in prompt/completion form plus a scorer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from forgetless.config.evaluation import ScorerConfig

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

    A multiple-choice example also has ``choices`` and the index ``label`` of the right one;
    its ``completion`` is then ``choices[label]`` (what training teaches).
    """

    prompt: str
    completion: str
    messages: tuple[Message, ...] | None = None
    choices: tuple[str, ...] | None = None
    label: int | None = None
    aliases: tuple[str, ...] = ()
    """Other answers accepted by the ``aliases`` scorer (lowercase), beside ``completion``."""

    def __post_init__(self) -> None:
        if self.choices is None:
            if self.label is not None:
                raise ValueError("an example with a label needs choices")
            return
        if len(self.choices) < 2 or self.label is None:
            raise ValueError("a multiple-choice example needs >= 2 choices and a label")
        if not 0 <= self.label < len(self.choices):
            raise ValueError(f"label {self.label} is out of range for {len(self.choices)} choices")


@dataclass(frozen=True)
class Task:
    """A named task with train and eval splits and how it is scored.

    ``scorer`` compares a generation with the reference under the default exact-match scoring;
    ``scoring`` selects another scorer (see ``forgetless.eval.scorers``); None means exact match.
    """

    name: str
    train: list[Example]
    eval: list[Example]
    description: str = ""
    scorer: Scorer = field(default=exact_match)
    max_new_tokens: int = 16
    scoring: ScorerConfig | None = None
    source_rows: int = 0
    """Training rows a file or dataset held before its ``n_train`` cap (0: not counted)."""

    def __post_init__(self) -> None:
        if not self.eval:
            raise ValueError(f"task {self.name!r} has an empty eval split")
        if self.scoring is not None and self.scoring.kind == "multiple_choice":
            missing = sum(e.choices is None for e in self.eval)
            if missing:
                raise ValueError(
                    f"task {self.name!r} is scored by multiple choice but {missing} eval "
                    "example(s) have no choices"
                )
