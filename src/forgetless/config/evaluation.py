"""Config of how a task is scored, and of lm-evaluation-harness retention probes.

Kept apart from ``schema.py`` and free of torch so that ``tasks.base`` can carry a task's scorer
choice without an import cycle.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from forgetless.core.fields import Count, NonNegative
from forgetless.strict import STRICT_CONFIG, StrictModel


class _Strict(StrictModel):
    model_config = ConfigDict(**STRICT_CONFIG, frozen=True)


class ExactMatchScorer(_Strict):
    """Greedy generation compared with the reference after stripping whitespace (the default)."""

    kind: Literal["exact_match"] = "exact_match"


class ContainsScorer(_Strict):
    """Greedy generation that contains the (stripped) reference anywhere."""

    kind: Literal["contains"] = "contains"


class StartsWithScorer(_Strict):
    """Greedy generation that starts with the (stripped) reference."""

    kind: Literal["startswith"] = "startswith"


class RegexScorer(_Strict):
    """The first match of ``pattern`` in the generation must equal the reference's answer.

    The reference's answer is its own match of ``pattern`` when it has one, else the whole
    reference; both sides are stripped. A generation without a match scores 0.
    """

    kind: Literal["regex"] = "regex"
    pattern: str
    """Python regular expression searched in the generation."""
    group: int = Field(1, ge=0)
    """Capture group holding the answer (0: the whole match)."""

    @model_validator(mode="after")
    def _compiles(self) -> RegexScorer:
        try:
            compiled = re.compile(self.pattern)
        except re.error as err:
            raise ValueError(f"scorer.pattern is not a valid regex: {err}") from None
        if self.group > compiled.groups:
            raise ValueError(
                f"scorer.group {self.group} but the pattern has {compiled.groups} group(s)"
            )
        return self


class NumericScorer(_Strict):
    """The generation's final number must equal the reference's (GSM8K-style ``#### 42``).

    The number after the last ``####`` counts; without one, the last number in the text counts
    unless ``strict``. Thousands separators (``1,234``), signs and decimals are understood and
    values are compared as decimals (``16.0`` equals ``16``). Unparsable output scores 0.
    """

    kind: Literal["numeric"] = "numeric"
    strict: bool = False
    """Only accept an answer written after '####'."""
    tolerance: NonNegative = 0.0
    """Absolute tolerance when comparing values."""


class MultipleChoiceScorer(_Strict):
    """Log-likelihood of each choice given the prompt; the most likely choice is the answer.

    ``acc`` ranks by the summed log-probability of the choice's tokens; ``acc_norm`` divides it
    by the choice's length in characters, as lm-evaluation-harness does.
    """

    kind: Literal["multiple_choice"] = "multiple_choice"
    metric: Literal["acc", "acc_norm"] = "acc"
    """Which accuracy enters the accuracy matrix (both are computed)."""


class AliasScorer(_Strict):
    """The reference or one of the example's aliases appears in the generation as whole words,
    ignoring case (short free-text answers: ``4`` or ``four``)."""

    kind: Literal["aliases"] = "aliases"


class EndsTurnScorer(_Strict):
    """The generation ends with the end-of-turn (EOS) token inside ``max_new_tokens``: the
    reference is not compared (chat-format discipline)."""

    kind: Literal["ends_turn"] = "ends_turn"


ScorerKind = Literal[
    "exact_match",
    "contains",
    "startswith",
    "regex",
    "numeric",
    "multiple_choice",
    "aliases",
    "ends_turn",
]
ScorerConfig = Annotated[
    Union[  # noqa: UP007
        ExactMatchScorer,
        ContainsScorer,
        StartsWithScorer,
        RegexScorer,
        NumericScorer,
        MultipleChoiceScorer,
        AliasScorer,
        EndsTurnScorer,
    ],
    Field(discriminator="kind"),
]
SCORER_KINDS: tuple[str, ...] = ScorerKind.__args__  # type: ignore[attr-defined]


def scorer_shorthand(value: Any) -> Any:
    """``"numeric"`` → ``{"kind": "numeric"}``; an unknown kind is a one-line error."""
    if isinstance(value, str):
        value = {"kind": value}
    if isinstance(value, dict):
        kind = value.get("kind")
        if kind not in SCORER_KINDS:
            raise ValueError(f"unknown scorer kind {kind!r}; known: {', '.join(SCORER_KINDS)}")
    return value


class LmEvalSettings(_Strict):
    """Which lm-evaluation-harness tasks to run as retention probes, and how."""

    tasks: list[str] = Field(min_length=1)
    """lm-eval task names, e.g. [hellaswag]."""
    limit: Count | None = None
    """Documents per task (null: all); keep it small."""
    num_fewshot: int | None = Field(None, ge=0)
    """Few-shot examples (null: task's)."""
    metric: str | None = None
    """Metric to record, e.g. acc_norm; null: acc_norm, acc, exact_match."""
    include_path: Path | None = None
    """Folder of custom lm-eval task YAMLs."""
    include_defaults: bool = True
    """Also index lm-eval's own tasks (false: only include_path; faster)."""
    apply_chat_template: bool = False
    """Render prompts with the chat template."""
    batch_size: Count | None = None
    """Default: eval.batch_size."""
    chance: float | None = Field(None, ge=0, lt=1)
    """Chance level of the metric, the floor of retention; null: 1/choices (averaged over documents)
    for a multiple-choice task, 0 for a generation task."""

    @field_validator("tasks")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        if any(not t.strip() for t in value) or len(set(value)) != len(value):
            raise ValueError("lm_eval.tasks must be distinct, non-empty task names")
        return value

    @model_validator(mode="after")
    def _somewhere_to_look(self) -> LmEvalSettings:
        if not self.include_defaults and self.include_path is None:
            raise ValueError("include_defaults false needs an include_path")
        return self


class LmEvalProbe(_Strict):
    """A retention probe run through lm-evaluation-harness (``pip install forgetless[lmeval]``).

    Written ``{lm_eval: {tasks: [hellaswag], limit: 100}}`` or ``"lmeval:hellaswag"``. Each task
    becomes one probe column named ``lmeval:<task>``.
    """

    lm_eval: LmEvalSettings

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str) and value.startswith(LMEVAL_PREFIX):
            return {"lm_eval": {"tasks": [value[len(LMEVAL_PREFIX) :]]}}
        return value

    @property
    def names(self) -> list[str]:
        return [f"{LMEVAL_PREFIX}{t}" for t in self.lm_eval.tasks]


LMEVAL_PREFIX = "lmeval:"


def is_lm_eval_probe(value: Any) -> bool:
    """Whether a raw probe entry is an lm-eval probe (a tag for the probe union)."""
    if isinstance(value, LmEvalProbe):
        return True
    if isinstance(value, str):
        return value.startswith(LMEVAL_PREFIX)
    return isinstance(value, dict) and "lm_eval" in value
