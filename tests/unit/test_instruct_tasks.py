"""Tests for the synthetic instruct task suite (no torch needed)."""

from __future__ import annotations

import json
import random
import re

import pytest

from forgetless.config.evaluation import ExactMatchScorer
from forgetless.tasks.base import Example
from forgetless.tasks.instruct import (
    EXTRACT_CITIES,
    EXTRACT_ITEMS,
    INSTRUCT_TASKS,
    NUMBER_WORDS,
    SKILLS,
    TOPIC_KEYWORDS,
    TOPIC_LABELS,
    InstructTaskSpec,
)

ALL = list(INSTRUCT_TASKS)
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _samples(name: str, n: int = 300, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    return [INSTRUCT_TASKS[name].generate(rng) for _ in range(n)]


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _quoted_words(prompt: str) -> list[str]:
    match = re.search(r'"([a-z ]+)"', prompt)
    assert match, prompt
    return match.group(1).split()


# --- the suite as a whole ----------------------------------------------------------------------


def test_eight_tasks_one_per_skill() -> None:
    assert len(INSTRUCT_TASKS) == 8
    assert sorted(spec.skill for spec in INSTRUCT_TASKS.values()) == sorted(SKILLS)
    assert set(SKILLS) == {
        "format",
        "numeric",
        "string",
        "classification",
        "multistep",
        "style",
        "list",
        "extraction",
    }
    for name, spec in INSTRUCT_TASKS.items():
        assert spec.name == name and name.startswith("it-")
        assert spec.description
        assert isinstance(spec.scoring, ExactMatchScorer)
        assert 1 <= spec.max_new_tokens <= 16
        assert spec.generate.__doc__  # each generator documents itself in one line


def test_spec_is_frozen_and_validated() -> None:
    spec = INSTRUCT_TASKS["it-json"]
    with pytest.raises(AttributeError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(ValueError, match="skill"):
        InstructTaskSpec("x", "x", "poetry", spec.generate, 8)  # type: ignore[arg-type]
    default = InstructTaskSpec("x", "x", "format", spec.generate, 8)
    assert default.scoring == ExactMatchScorer()


# --- per-task invariants -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_deterministic_for_a_seed(name: str) -> None:
    assert _samples(name, 200, seed=7) == _samples(name, 200, seed=7)
    assert _samples(name, 200, seed=7) != _samples(name, 200, seed=8)


@pytest.mark.parametrize("name", ALL)
def test_enough_distinct_prompts(name: str) -> None:
    prompts = {ex.prompt for ex in _samples(name, 5000, seed=1)}
    assert len(prompts) >= 1100


@pytest.mark.parametrize("name", ALL)
def test_prompt_and_completion_shape(name: str) -> None:
    for ex in _samples(name, 2000, seed=2):
        assert ex.prompt.isascii() and ex.completion.isascii()
        assert ex.prompt.endswith(("?", ".", ":")), ex.prompt
        assert len(ex.prompt.split()) <= 40, ex.prompt
        assert 0 < len(ex.completion) <= 30, ex.completion
        assert ex.completion == ex.completion.strip()
        assert ex.choices is None and ex.messages is None


@pytest.mark.parametrize("name", ALL)
def test_a_prompt_has_one_answer(name: str) -> None:
    """The same prompt never maps to two different completions."""
    answers: dict[str, str] = {}
    for ex in _samples(name, 5000, seed=3):
        assert answers.setdefault(ex.prompt, ex.completion) == ex.completion


# --- per-task correctness ----------------------------------------------------------------------


def test_json_names_the_animal() -> None:
    for ex in _samples("it-json"):
        value = json.loads(ex.completion)
        assert list(value) == ["animal"]
        sentence = ex.prompt.rsplit(": ", 1)[1]
        assert sentence.startswith("The ") and sentence.split()[2] == value["animal"]
        assert ex.completion == f'{{"animal": "{value["animal"]}"}}'


def test_arith_recomputes() -> None:
    seen = set()
    for ex in _samples("it-arith", 600):
        assert ex.prompt.endswith("Answer with a number only.")
        a, b = _ints(ex.prompt)
        assert a <= 9 and b <= 5, ex.prompt
        if re.search(r"\bmore\b", ex.prompt):
            expected, seen_op = a + b, "add"
        else:
            expected, seen_op = a - b, "sub"
        seen.add(seen_op)
        assert ex.completion == str(expected), ex.prompt
    assert seen == {"add", "sub"}


def test_wordrev_reverses_the_words() -> None:
    for ex in _samples("it-wordrev"):
        words = _quoted_words(ex.prompt)
        assert 3 <= len(words) <= 4
        assert ex.completion.split() == words[::-1]


def test_topic_label_follows_the_keyword() -> None:
    assert set(TOPIC_KEYWORDS) == set(TOPIC_LABELS)
    owners = [k for kws in TOPIC_KEYWORDS.values() for k in kws]
    assert len(owners) == len(set(owners))  # no keyword under two labels
    labels = set()
    for ex in _samples("it-topic", 600):
        words = set(re.findall(r"[a-z]+", ex.prompt))
        present = {label for label, kws in TOPIC_KEYWORDS.items() if words & set(kws)}
        assert present == {ex.completion}, ex.prompt
        assert all(label in ex.prompt for label in TOPIC_LABELS)
        labels.add(ex.completion)
    assert labels == set(TOPIC_LABELS)


_EDIT = re.compile(
    r"(?:remove|delete|take out) (\w+)|(?:add (\w+) at the end|append (\w+))|"
    r"(?:add (\w+) at the start|put (\w+) first)",
    re.IGNORECASE,
)


def test_steps_replay_the_list_edits() -> None:
    kinds = set()
    for ex in _samples("it-steps", 600):
        rest = ex.prompt.partition(": ")[2]
        items = rest.split(".")[0].split(", ")
        assert len(items) == 3, ex.prompt
        edits = _EDIT.findall(rest)
        assert len(edits) == 2, ex.prompt
        for removed, end, append, start_word, first in edits:
            if removed:
                items.remove(removed)
                kinds.add("remove")
            elif end or append:
                items.append(end or append)
                kinds.add("end")
            else:
                items.insert(0, start_word or first)
                kinds.add("start")
        assert ex.completion == ", ".join(items), ex.prompt
    assert kinds == {"remove", "end", "start"}


def test_robot_reply_format_and_answers() -> None:
    for ex in _samples("it-robot", 1000):
        match = re.fullmatch(r"BEEP\. ([A-Z]+)\. BEEP\.", ex.completion)
        assert match, ex.completion
        answer = match.group(1).lower()
        assert "robot" in ex.prompt and ex.prompt.endswith("?")
        q = ex.prompt.lower()
        if m := re.search(r"comes after (\d+)\?", q):
            assert answer == NUMBER_WORDS[int(m.group(1)) + 1]
        elif 'opposite of "hot"' in q:
            assert answer == "cold"
        elif "legs does a spider" in q:
            assert answer == "eight"
        elif m := re.search(r"which day comes after (\w+)\?", q):
            day = DAYS.index(m.group(1).capitalize())
            assert answer == DAYS[(day + 1) % 7].lower()
        elif "what colour is grass?" in q:
            assert answer == "green"


def test_sortwords_sorts() -> None:
    for ex in _samples("it-sortwords"):
        match = re.search(r": ([a-z ]+)\.$", ex.prompt)
        assert match, ex.prompt
        words = match.group(1).split()
        assert 3 <= len(words) <= 4
        assert len({w[0] for w in words}) == len(words)
        assert ex.completion == ", ".join(sorted(words))
        assert ex.completion.split(", ") == sorted(ex.completion.split(", "))


def test_extract_reads_the_asked_field() -> None:
    for ex in _samples("it-extract", 600):
        assert ex.prompt.endswith("Answer with one word.")
        record, question = ex.prompt.split(". ", 1)
        assert re.search(rf"\b{ex.completion}\b", record), ex.prompt
        if "city" in question:
            assert ex.completion in EXTRACT_CITIES
        elif "day" in question:
            assert ex.completion in DAYS
        else:
            assert "item" in question and ex.completion in EXTRACT_ITEMS
        # Exactly one value of the asked kind occurs in the record.
        for pool in (EXTRACT_CITIES, DAYS, EXTRACT_ITEMS):
            if ex.completion in pool:
                assert sum(re.search(rf"\b{v}\b", record) is not None for v in pool) == 1


def test_train_and_eval_can_be_disjoint() -> None:
    """1100 distinct prompts are reachable without exhausting the example space."""
    for name in ALL:
        rng = random.Random(f"forgetless/{name}/0")
        seen: set[str] = set()
        draws = 0
        while len(seen) < 1100 and draws < 3000:
            seen.add(INSTRUCT_TASKS[name].generate(rng).prompt)
            draws += 1
        assert len(seen) == 1100, name
