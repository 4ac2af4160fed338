"""Tests for the built-in synthetic task suite (no torch needed)."""

from __future__ import annotations

import random
import re

import pytest

from forgetless.config.schema import BASE_MIXTURE
from forgetless.tasks.base import Example
from forgetless.tasks.builtin import (
    BUILTIN_TASKS,
    CIPHER_KEY,
    FACTS,
    BuiltinTaskSpec,
    _sample_unique,
    base_capability_names,
    build_builtin_task,
    latent_skill_names,
    sequence_task_names,
)

ALL = list(BUILTIN_TASKS)
NON_FACTS = [n for n in ALL if n != "facts"]


def _samples(name: str, n: int = 300, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    return [BUILTIN_TASKS[name].generate(rng) for _ in range(n)]


def _arg(prompt: str, marker: str) -> str:
    assert prompt.startswith(marker + " ") and prompt.endswith("=")
    return prompt[len(marker) + 1 : -1]


def _probe_arg(prompt: str, marker: str) -> str:
    assert prompt.startswith(marker + ": ") and prompt.endswith(" >")
    return prompt[len(marker) + 2 : -2]


def test_suite_composition() -> None:
    assert len(BUILTIN_TASKS) >= 10
    base = base_capability_names()
    assert base == ["copy", "upper", "facts", "add"]
    assert ALL[: len(base)] == base  # base capabilities come first
    assert list(BASE_MIXTURE) == base + latent_skill_names()
    for latent in latent_skill_names():
        assert latent.removeprefix("ask-") in sequence_task_names()
    assert set(sequence_task_names()) >= {
        "reverse",
        "sort",
        "count",
        "cipher",
        "bracket",
        "wordprob",
    }
    assert set(base).isdisjoint(sequence_task_names())
    for name, spec in BUILTIN_TASKS.items():
        assert spec.name == name
        assert spec.description and "\n" not in spec.description


@pytest.mark.parametrize("name", ALL)
def test_determinism(name: str) -> None:
    a = build_builtin_task(name, 50, 20, seed=1)
    b = build_builtin_task(name, 50, 20, seed=1)
    c = build_builtin_task(name, 50, 20, seed=2)
    assert a.train == b.train and a.eval == b.eval
    assert (a.train, a.eval) != (c.train, c.eval)
    assert len(a.train) == 50 and len(a.eval) == 20
    assert a.name == name and a.description == BUILTIN_TASKS[name].description


def test_eval_independent_of_n_train() -> None:
    assert build_builtin_task("add", 10, 20, 0).eval == build_builtin_task("add", 90, 20, 0).eval


@pytest.mark.parametrize("name", NON_FACTS)
def test_train_eval_disjoint(name: str) -> None:
    task = build_builtin_task(name, 400, 100, seed=0)
    train_prompts = [ex.prompt for ex in task.train]
    eval_prompts = [ex.prompt for ex in task.eval]
    assert len(set(train_prompts)) == len(train_prompts)
    assert len(set(eval_prompts)) == len(eval_prompts)
    assert not set(train_prompts) & set(eval_prompts)


def test_facts_recall_splits() -> None:
    task = build_builtin_task("facts", 200, 1000, seed=0)
    assert 40 <= len(FACTS) <= 60
    assert sorted(task.eval, key=lambda e: e.prompt) == sorted(FACTS, key=lambda e: e.prompt)
    assert len(task.train) == 200 and set(task.train) == set(FACTS)
    assert len({ex.prompt for ex in FACTS}) == len(FACTS)


@pytest.mark.parametrize("name", ALL)
def test_format_constraints(name: str) -> None:
    spec = BUILTIN_TASKS[name]
    task = build_builtin_task(name, 300, 100, seed=3)
    examples = _samples(name) + task.train + task.eval
    longest = 0
    for ex in examples:
        for text in (ex.prompt, ex.completion):
            assert all(32 <= ord(ch) <= 126 for ch in text), text
        assert len(ex.prompt) <= 28 and 1 <= len(ex.completion) <= 12
        assert ex.prompt[-1] in "=?>"
        assert ex.completion == ex.completion.strip()
        assert len(ex.completion) <= spec.max_completion
        longest = max(longest, len(ex.completion))
    assert longest == spec.max_completion  # the bound is tight on a sample this size
    assert task.max_new_tokens == spec.max_completion + 2


def test_probe_formats_are_apart_from_the_sequence_tasks() -> None:
    for name in base_capability_names() + latent_skill_names():
        assert all(ex.prompt.endswith(" >") for ex in _samples(name, 50))
    for name in sequence_task_names():
        assert not any(ex.prompt.endswith(">") for ex in _samples(name, 50))


def test_latent_skills_are_their_sequence_rule_in_the_base_format() -> None:
    for latent in latent_skill_names():
        task = latent.removeprefix("ask-")
        for a, b in zip(_samples(latent, 50), _samples(task, 50), strict=True):
            assert a.completion == b.completion  # same rule on the same draws
            assert b.prompt.split(" ", 1)[1].rstrip("=?") in a.prompt


def test_task_markers_distinguish_tasks() -> None:
    markers = {name: _samples(name, 1)[0].prompt.split(" ")[0] for name in ALL}
    assert len(set(markers.values())) == len(ALL)
    for name in ALL:
        assert {ex.prompt.split(" ")[0] for ex in _samples(name, 50)} == {markers[name]}


def test_copy_upper_reverse_sort_bracket() -> None:
    for ex in _samples("copy"):
        assert ex.completion == _probe_arg(ex.prompt, "copy")
    for ex in _samples("upper"):
        assert ex.completion == _probe_arg(ex.prompt, "upper").upper()
    for ex in _samples("reverse"):
        s = _arg(ex.prompt, "rev")
        assert 3 <= len(s) <= 6 and s.islower() and ex.completion == s[::-1]
    for ex in _samples("sort"):
        assert ex.completion == "".join(sorted(_arg(ex.prompt, "sort")))
    for ex in _samples("bracket"):
        assert ex.completion == "[" + _arg(ex.prompt, "fmt").upper() + "]"


def test_facts_generator() -> None:
    answers = {ex.prompt: ex.completion for ex in FACTS}
    for ex in _samples("facts"):
        assert re.fullmatch(r"fact: [a-z]+ of [a-z]+ >", ex.prompt)
        assert answers[ex.prompt] == ex.completion


def test_add() -> None:
    for ex in _samples("add"):
        m = re.fullmatch(r"sum: (\d+)\+(\d+) >", ex.prompt)
        assert m is not None
        a, b = int(m.group(1)), int(m.group(2))
        assert 100 <= a <= 999 and 1 <= b <= 9 and ex.completion == str(a + b)


def test_count() -> None:
    seen = set()
    for ex in _samples("count"):
        m = re.fullmatch(r"cnt ([a-z]) in ([a-z]+)=", ex.prompt)
        assert m is not None
        assert ex.completion == str(m.group(2).count(m.group(1)))
        seen.add(ex.completion)
    assert len(seen) >= 4  # counts actually vary


def test_cipher_consistent_bijection() -> None:
    assert sorted(CIPHER_KEY) == sorted("abcdefghijklmnopqrstuvwxyz")
    mapping: dict[str, str] = {}
    for ex in _samples("cipher"):
        s = _arg(ex.prompt, "enc")
        assert len(ex.completion) == len(s)
        for plain, enc in zip(s, ex.completion, strict=True):
            assert mapping.setdefault(plain, enc) == enc
            assert enc == CIPHER_KEY[ord(plain) - ord("a")]
    assert len(set(mapping.values())) == len(mapping)


def _apply(x: int, op: str) -> int:
    k = int(op[1:])
    return {"+": x + k, "-": x - k, "*": x * k}[op[0]]


def test_wordprob() -> None:
    for ex in _samples("wordprob", 500):
        m = re.fullmatch(r"wp a=(\d),b=a([-+*]\d),c=b([-+*]\d);c\?", ex.prompt)
        assert m is not None, ex.prompt
        b = _apply(int(m.group(1)), m.group(2))
        c = _apply(b, m.group(3))
        assert 0 <= b <= 99 and 0 <= c <= 99
        assert ex.completion == str(c)


def test_unknown_name() -> None:
    with pytest.raises(KeyError) as info:
        build_builtin_task("nope", 10, 10, 0)
    for name in ALL:
        assert name in str(info.value)


def test_bad_sizes() -> None:
    with pytest.raises(ValueError):
        build_builtin_task("copy", 10, 0, 0)


def test_small_space_caps_without_looping() -> None:
    def tiny(rng: random.Random) -> Example:
        x = rng.choice("abc")
        return Example(f"t {x}=", x)

    out = _sample_unique(tiny, 1000, random.Random(0), patience=200)
    assert sorted(ex.prompt for ex in out) == ["t a=", "t b=", "t c="]
    task = build_builtin_task("facts", 10, 10_000, seed=0)
    assert len(task.eval) == len(FACTS)


def test_build_caps_small_space(monkeypatch: pytest.MonkeyPatch) -> None:
    def tiny(rng: random.Random) -> Example:
        x = rng.choice("abcd")
        return Example(f"t {x}=", x)

    spec = BuiltinTaskSpec("tiny", "tiny", False, tiny, 1)
    monkeypatch.setitem(BUILTIN_TASKS, "tiny", spec)
    task = build_builtin_task("tiny", 300, 100, seed=0)
    assert len(task.train) + len(task.eval) == 4 and len(task.eval) == 1
    assert not {ex.prompt for ex in task.train} & {ex.prompt for ex in task.eval}
