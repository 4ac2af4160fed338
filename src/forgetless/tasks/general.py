"""General-capability probes for a real instruct LM, from data shipped with the package.

* ``gk-mc``: the question set (``assets/smollm2/questions.jsonl``, 320 items written for this
  project), four choices ranked by log-likelihood as the assistant's reply to the question and
  "Answer in a few words." (the instruction makes the answer the reply's first words: without
  it the base scores 0.51 instead of 0.57, with the choices listed in the prompt 0.30);
* ``gk-short``: the same questions answered freely in a few words, right when the answer or one
  of its aliases appears as a whole word (case-insensitive);
* ``chat-format``: brief answers that must end with the end-of-turn token inside the budget,
  the share that does is the score (chat-format discipline);
* the prose (``assets/smollm2/prose.txt``, 48 paragraphs written for this project) is not a task:
  ``forgetless.eval.prose`` measures perplexity and token KL to the base on it.

Each probe's eval split is a seeded order of the whole set, so ``n_eval`` takes a prefix; the
rest of the order is its train split, which nothing trains on: a forgetting budget draws its
held-out probe batch from it (``forgetless.training.budget_probe``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from forgetless.config.evaluation import (
    AliasScorer,
    EndsTurnScorer,
    MultipleChoiceScorer,
    ScorerConfig,
)
from forgetless.tasks.base import Example, Task

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "smollm2"
QUESTIONS = ASSETS / "questions.jsonl"
PROSE = ASSETS / "prose.txt"
SHORT_ANSWER = "Answer in a few words."
ONE_SENTENCE = "Answer in one short sentence."


@cache
def questions() -> tuple[dict[str, Any], ...]:
    lines = QUESTIONS.read_text(encoding="utf-8").splitlines()
    return tuple(json.loads(line) for line in lines if line.strip())


def prose_paragraphs() -> list[str]:
    return [p.strip() for p in PROSE.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def _mc(item: dict[str, Any]) -> Example:
    choices = tuple(item["choices"])
    prompt = f"{item['question']} {SHORT_ANSWER}"
    return Example(prompt, item["answer"], choices=choices, label=item["label"])


def _short(item: dict[str, Any]) -> Example:
    return Example(
        f"{item['question']} {SHORT_ANSWER}", item["answer"], aliases=tuple(item["aliases"])
    )


def _sentence(item: dict[str, Any]) -> Example:
    return Example(f"{item['question']} {ONE_SENTENCE}", item["answer"])


GENERAL_PROBES: dict[str, tuple[str, Callable[[dict[str, Any]], Example], int, ScorerConfig]] = {
    "gk-mc": (
        "general-knowledge questions, 4 choices by log-likelihood",
        _mc,
        4,
        MultipleChoiceScorer(metric="acc"),
    ),
    "gk-short": ("general-knowledge questions answered in a few words", _short, 16, AliasScorer()),
    "chat-format": (
        "brief answers that end their turn inside 48 tokens",
        _sentence,
        48,
        EndsTurnScorer(),
    ),
}
"""name -> (description, example builder, max_new_tokens, scoring)."""


def build_general_probe(name: str, n_eval: int, seed: int) -> Task:
    """The probe over a seeded order of the question set: the first ``n_eval`` items, the rest
    held out (its train split)."""
    description, build, max_new_tokens, scoring = GENERAL_PROBES[name]
    items = list(questions())
    random.Random(f"forgetless/{name}/{seed}").shuffle(items)
    return Task(
        name=name,
        train=[build(item) for item in items[n_eval:]],
        eval=[build(item) for item in items[:n_eval]],
        description=description,
        max_new_tokens=max_new_tokens,
        scoring=scoring,
    )
