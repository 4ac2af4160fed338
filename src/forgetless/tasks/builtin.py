"""Built-in suite of seeded, deterministic synthetic text tasks.

Each task is a different skill that a tiny character-level causal LM can learn on CPU in a few
hundred steps. Prompts carry a short task marker and end with a delimiter (``=``, ``?``); the
completion is appended directly after the prompt. Everything is printable ASCII, prompts are at
most 28 characters and completions at most 12.

Two groups:

* base capabilities (``copy``, ``upper``, ``facts``, ``add``) pretrain the base model and are then
  used as retention probes;
* sequence tasks (``reverse``, ``sort``, ``count``, ``cipher``, ``bracket``, ``wordprob``,
  ``addmc``, ``calc``) are learned one after another in continual post-training.

Most tasks are scored by exact match of a greedy generation. ``addmc`` is multiple choice, scored
by the log-likelihood of each choice; ``calc`` writes a working step before a GSM8K-style
``#### answer`` and is scored on the parsed number alone (``forgetless.eval.scorers``).

Train and eval splits are disjoint by prompt, except for ``facts``: its skill is *recall* of a
fixed knowledge base, so eval holds the KB facts and train is the same KB, repeated.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from forgetless.config.evaluation import (
    ExactMatchScorer,
    MultipleChoiceScorer,
    NumericScorer,
    ScorerConfig,
)
from forgetless.core.registry import did_you_mean
from forgetless.tasks.base import Example, Task
from forgetless.tasks.general import GENERAL_PROBES, build_general_probe
from forgetless.tasks.instruct import INSTRUCT_TASKS

LETTERS = string.ascii_lowercase


@dataclass(frozen=True)
class BuiltinTaskSpec:
    """A built-in task: a name, a one-line description and a generator of random examples.

    ``max_completion`` is the longest completion in the task's whole example space (characters);
    ``scoring`` is how the task is scored unless its config says otherwise.
    """

    name: str
    description: str
    base_capability: bool
    generate: Callable[[random.Random], Example]
    max_completion: int = 12
    scoring: ScorerConfig = field(default_factory=ExactMatchScorer)


def _word(rng: random.Random, lo: int, hi: int, alphabet: str = LETTERS) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


# --- base capabilities ---------------------------------------------------------------------------


def _copy(rng: random.Random) -> Example:
    s = _word(rng, 3, 8)
    return Example(f"copy: {s} >", s)


def _upper(rng: random.Random) -> Example:
    s = _word(rng, 3, 8)
    return Example(f"upper: {s} >", s.upper())


# A fixed, made-up knowledge base: 12 entities x 4 attributes = 48 facts.
_ATTRIBUTES = ("capital", "color", "river", "animal")
_KB: tuple[tuple[str, str, str, str, str], ...] = (
    ("zorbia", "kelm", "red", "isk", "owl"),
    ("quelt", "avor", "blue", "vanda", "fox"),
    ("mirados", "sitra", "green", "moru", "yak"),
    ("vantor", "brund", "gold", "pell", "eel"),
    ("plimb", "olme", "gray", "azre", "bat"),
    ("drezka", "takka", "pink", "tobb", "elk"),
    ("ostrel", "veris", "teal", "lunn", "ant"),
    ("yumbar", "nump", "ochre", "ekra", "emu"),
    ("kavix", "hald", "white", "sivo", "cat"),
    ("tereth", "corin", "black", "durm", "dog"),
    ("glorn", "drae", "amber", "qell", "ram"),
    ("fennic", "ploss", "violet", "orra", "hen"),
)
FACTS: tuple[Example, ...] = tuple(
    Example(f"fact: {attr} of {row[0]} >", value)
    for row in _KB
    for attr, value in zip(_ATTRIBUTES, row[1:], strict=True)
)


def _facts(rng: random.Random) -> Example:
    return rng.choice(FACTS)


def _add(rng: random.Random) -> Example:
    a, b = rng.randint(100, 999), rng.randint(1, 9)
    return Example(f"sum: {a}+{b} >", str(a + b))


# --- sequence tasks ------------------------------------------------------------------------------


def _reverse(rng: random.Random) -> Example:
    s = _word(rng, 3, 6)
    return Example(f"rev {s}=", s[::-1])


def _sort(rng: random.Random) -> Example:
    s = _word(rng, 3, 6)
    return Example(f"sort {s}=", "".join(sorted(s)))


def _count(rng: random.Random) -> Example:
    # A small alphabet so that counts vary (0..9) instead of being almost always 0 or 1.
    s, c = _word(rng, 4, 9, "abcde"), rng.choice("abcde")
    return Example(f"cnt {c} in {s}=", str(s.count(c)))


CIPHER_KEY = "qwertyuiopasdfghjklzxcvbnm"  # fixed substitution: a->q, b->w, c->e, ...
_CIPHER = str.maketrans(LETTERS, CIPHER_KEY)


def _cipher(rng: random.Random) -> Example:
    s = _word(rng, 3, 6)
    return Example(f"enc {s}=", s.translate(_CIPHER))


def _bracket(rng: random.Random) -> Example:
    s = _word(rng, 3, 6)
    return Example(f"fmt {s}=", f"[{s.upper()}]")


def _step(rng: random.Random, x: int) -> tuple[str, int]:
    """One arithmetic step on ``x`` keeping every value in 0..99: returns (op+constant, result)."""
    ops = [op for op, ok in (("+", x <= 98), ("-", x >= 1), ("*", 2 * x <= 99)) if ok]
    op = rng.choice(ops)
    if op == "+":
        k = rng.randint(1, min(9, 99 - x))
        return f"+{k}", x + k
    if op == "-":
        k = rng.randint(1, min(9, x))
        return f"-{k}", x - k
    k = rng.randint(2, min(9, 99 // x) if x else 9)
    return f"*{k}", x * k


def _wordprob(rng: random.Random) -> Example:
    a = rng.randint(1, 9)
    op1, b = _step(rng, a)
    op2, c = _step(rng, b)
    return Example(f"wp a={a},b=a{op1},c=b{op2};c?", str(c))


def _addmc(rng: random.Random) -> Example:
    """Pick the sum among four choices; distractors are off by 1, 2 or 10 (lengths may differ,
    so raw and length-normalised log-likelihood can disagree)."""
    a, b = rng.randint(10, 99), rng.randint(1, 99)
    total = a + b
    offsets = rng.sample([o for o in (-10, -2, -1, 1, 2, 10) if total + o > 0], 3)
    choices = [str(total), *(str(total + o) for o in offsets)]
    rng.shuffle(choices)
    label = choices.index(str(total))
    return Example(f"pick {a}+{b}=", str(total), choices=tuple(choices), label=label)


def _double(rng: random.Random) -> Example:
    s = _word(rng, 2, 5)
    return Example(f"dup {s}=", s + s)


def _calc(rng: random.Random) -> Example:
    """GSM8K-style: a working step, then ``#### answer`` (values 2..57)."""
    a, b, c = rng.randint(10, 49), rng.randint(1, 9), rng.randint(1, 9)
    return Example(f"calc {a}+{b}-{c}?", f"{a + b}-{c} #### {a + b - c}")


def _asked(
    marker: str, rule: Callable[[random.Random], Example]
) -> Callable[[random.Random], Example]:
    """A sequence skill asked in the base's own format (``marker: arg >``): the same rule on the
    same strings, so that the base holds it latent and a sequence task teaches its new format."""

    def generate(rng: random.Random) -> Example:
        ex = rule(rng)
        arg = ex.prompt.split(" ", 1)[1].rstrip("=?")
        return Example(f"{marker}: {arg} >", ex.completion)

    return generate


LATENT_SKILLS = (
    ("reverse", "reverse", _reverse, 6),
    ("sort", "sort", _sort, 6),
    ("count", "count", _count, 1),
    ("cipher", "encode", _cipher, 6),
    ("bracket", "wrap", _bracket, 8),
    ("double", "twice", _double, 10),
    ("addmc", "plus", _addmc, 3),
    ("calc", "compute", _calc, 12),
)
"""Sequence skills the base learns in its own format and is never probed on (see
``docs/tiny-suite.md``): a sequence task then teaches a new format for a skill the base holds,
as instruction tuning does for an LLM, so it is learned in a short budget at a gentle rate."""

BUILTIN_TASKS: dict[str, BuiltinTaskSpec] = {
    spec.name: spec
    for spec in (
        BuiltinTaskSpec("copy", "repeat a short lowercase string", True, _copy, 8),
        BuiltinTaskSpec("upper", "uppercase a short lowercase string", True, _upper, 8),
        BuiltinTaskSpec(
            "facts",
            "recall facts of a fixed made-up knowledge base (train = eval = the KB)",
            True,
            _facts,
            max(len(ex.completion) for ex in FACTS),
        ),
        BuiltinTaskSpec("add", "add a 1-digit number to a 3-digit one", True, _add, 4),
        *(
            BuiltinTaskSpec(
                f"ask-{task}",
                f"the {task} skill asked in the base's format ('{marker}: ... >')",
                True,
                _asked(marker, rule),
                width,
            )
            for task, marker, rule, width in LATENT_SKILLS
        ),
        BuiltinTaskSpec("reverse", "reverse a 3-6 letter string", False, _reverse, 6),
        BuiltinTaskSpec("sort", "sort the letters of a 3-6 letter string", False, _sort, 6),
        BuiltinTaskSpec("count", "count occurrences of a letter in a string", False, _count, 1),
        BuiltinTaskSpec(
            "cipher", "encode with a fixed letter substitution cipher", False, _cipher, 6
        ),
        BuiltinTaskSpec(
            "bracket", "format rule: uppercase and wrap in [brackets]", False, _bracket, 8
        ),
        BuiltinTaskSpec("double", "write a 2-5 letter string twice", False, _double, 10),
        BuiltinTaskSpec(
            "wordprob", "3-step arithmetic word problem (values 0-99)", False, _wordprob, 2
        ),
        BuiltinTaskSpec(
            "addmc",
            "pick the sum of two numbers among 4 choices (log-likelihood)",
            False,
            _addmc,
            3,
            MultipleChoiceScorer(metric="acc"),
        ),
        BuiltinTaskSpec(
            "calc",
            "add then subtract, answer after '####' (numeric scorer)",
            False,
            _calc,
            12,
            NumericScorer(strict=False, tolerance=0.0),
        ),
    )
}


def base_capability_names() -> list[str]:
    """Names of the probed base capabilities, in suite order (the latent skills left out)."""
    return [
        name
        for name, spec in BUILTIN_TASKS.items()
        if spec.base_capability and not name.startswith("ask-")
    ]


def latent_skill_names() -> list[str]:
    """Names of the latent skills: in the base's mixture, never probed (``LATENT_SKILLS``)."""
    return [f"ask-{task}" for task, *_ in LATENT_SKILLS]


def sequence_task_names() -> list[str]:
    """Names of the continual-learning sequence tasks, in suite order."""
    return [name for name, spec in BUILTIN_TASKS.items() if not spec.base_capability]


def _sample_unique(
    generate: Callable[[random.Random], Example], n: int, rng: random.Random, patience: int = 2000
) -> list[Example]:
    """Up to ``n`` examples with distinct prompts; stops after ``patience`` draws in a row that
    bring no new prompt, so a small example space caps the result instead of looping forever."""
    seen: set[str] = set()
    out: list[Example] = []
    misses = 0
    while len(out) < n and misses < patience:
        ex = generate(rng)
        if ex.prompt in seen:
            misses += 1
            continue
        seen.add(ex.prompt)
        out.append(ex)
        misses = 0
    return out


def _facts_splits(
    n_train: int, n_eval: int, rng: random.Random
) -> tuple[list[Example], list[Example]]:
    """Recall task: eval = the KB facts (at most all of them), train = the KB repeated, each
    pass shuffled, so every fact is seen about equally often."""
    eval_ = rng.sample(FACTS, min(n_eval, len(FACTS)))
    train: list[Example] = []
    while len(train) < n_train:
        train.extend(rng.sample(FACTS, len(FACTS)))
    return train[:n_train], eval_


def known_task_names() -> list[str]:
    """Every built-in name: the tiny suite, then the real track's instruct tasks and probes."""
    return [*BUILTIN_TASKS, *INSTRUCT_TASKS, *GENERAL_PROBES]


def unknown_task(name: str) -> str:
    """The one line for a built-in task name that does not exist, with the closest one."""
    known = known_task_names()
    return f"unknown built-in task {name!r}; known: {', '.join(known)}{did_you_mean(name, known)}"


def _splits(
    generate: Callable[[random.Random], Example], n_train: int, n_eval: int, rng: random.Random
) -> tuple[list[Example], list[Example]]:
    pool = _sample_unique(generate, n_train + n_eval, rng)
    total = n_train + n_eval
    k = n_eval if len(pool) == total else max(1, len(pool) * n_eval // total)
    return pool[k:], pool[:k]


def build_builtin_task(name: str, n_train: int, n_eval: int, seed: int) -> Task:
    """Build a built-in task; deterministic in ``(name, n_train, n_eval, seed)``.

    Eval is drawn first, so it depends only on ``(name, n_eval, seed)``. Where the example space
    is too small the splits are capped (eval keeps its share in proportion).
    """
    if name not in known_task_names():
        raise KeyError(unknown_task(name))
    if n_train < 0 or n_eval < 1:
        raise ValueError(f"need n_train >= 0 and n_eval >= 1, got {n_train}, {n_eval}")
    if name in GENERAL_PROBES:
        return build_general_probe(name, n_eval, seed)
    # A str seed is hashed with SHA-512 by `random` (stable across processes, unlike hash()).
    rng = random.Random(f"forgetless/{name}/{seed}")
    if name in INSTRUCT_TASKS:
        it = INSTRUCT_TASKS[name]
        train, eval_ = _splits(it.generate, n_train, n_eval, rng)
        return Task(
            name, train, eval_, it.description, max_new_tokens=it.max_new_tokens, scoring=it.scoring
        )
    spec = BUILTIN_TASKS[name]
    if name == "facts":
        train, eval_ = _facts_splits(n_train, n_eval, rng)
    else:
        train, eval_ = _splits(spec.generate, n_train, n_eval, rng)
    return Task(
        name=name,
        train=train,
        eval=eval_,
        description=spec.description,
        max_new_tokens=spec.max_completion + 2,
        scoring=spec.scoring,
    )
