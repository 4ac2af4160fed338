"""Synthetic instruction-following suite for a small instruct LM (e.g. SmolLM2-135M-Instruct).

Each task is one skill written as a natural-language English request: the prompt becomes a user
turn of the model's chat template and the completion is the assistant's reply. Eight skills, one
task each:

* ``it-json`` (format): name the animal in a sentence as ``{"animal": "fox"}``;
* ``it-arith`` (numeric): a one-step single-digit word problem, answered with the number only;
* ``it-wordrev`` (string): write 3-4 quoted words in reverse order;
* ``it-topic`` (classification): label a sentence as sports, food, weather or music;
* ``it-steps`` (multistep): edit a word list in two steps (remove a word, add one);
* ``it-robot`` (style): answer a very easy question as a robot, ``BEEP. GREEN. BEEP.``;
* ``it-sortwords`` (list): sort 3-4 words alphabetically, comma-separated;
* ``it-extract`` (extraction): read one field (city, day or item) out of a short order record.

Every rule is fixed and simple, so that a LoRA learns it in about a hundred steps of batch 8,
while the exact form of the reply (JSON spacing, a bare number, a lowercase label, the robot
frame) is specific enough that the untuned instruct model mostly does not produce it verbatim.

Prompts are ASCII, at most about 40 words, drawn from 2-4 phrasings per task and from small
vocabularies written below (no external data). Completions are at most 30 characters and
``max_new_tokens`` bounds them tightly. Each task's example space holds well over 3000 distinct
prompts, so disjoint train (1000) and eval (100) splits can be drawn. Generators are
deterministic given the ``random.Random`` they are passed. All tasks are scored by exact match
of the greedy generation after stripping whitespace.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from forgetless.config.evaluation import ExactMatchScorer, ScorerConfig
from forgetless.tasks.base import Example

Skill = Literal[
    "format", "numeric", "string", "classification", "multistep", "style", "list", "extraction"
]
SKILLS: tuple[Skill, ...] = get_args(Skill)


@dataclass(frozen=True)
class InstructTaskSpec:
    """An instruct task: a name, a description, its skill and a generator of random examples.

    ``max_new_tokens`` bounds the greedy generation at evaluation; ``scoring`` is how the task is
    scored unless its config says otherwise.
    """

    name: str
    description: str
    skill: Skill
    generate: Callable[[random.Random], Example]
    max_new_tokens: int
    scoring: ScorerConfig = field(default_factory=ExactMatchScorer)

    def __post_init__(self) -> None:
        if self.skill not in SKILLS:
            raise ValueError(f"unknown skill {self.skill!r}; known: {', '.join(SKILLS)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


# --- shared vocabularies -------------------------------------------------------------------------


def _words(text: str) -> tuple[str, ...]:
    """The whitespace-separated words of ``text`` (a compact way to write a vocabulary)."""
    return tuple(text.split())


_NAMES = _words("Tom Anna Sam Lily Ben Mia Jack Emma Leo Zoe Max Ruby")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")

# Short common words, at most five letters, for the string and list tasks.
_WORDS = _words(
    "apple bread cat door egg fish goat hat ink jam kite lamp milk nest owl pen queen "
    "rain sun tree up vase wind yard zoo bird cup dog frog girl hill lake moon road ship "
    "star"
)

# --- format: JSON ------------------------------------------------------------------------------

_ANIMALS = _words(
    "fox dog cat horse rabbit goat sheep duck mouse bear wolf deer pig cow owl frog tiger "
    "lion donkey squirrel"
)
_ADJECTIVES = _words("old young small big brown white black quiet happy tired hungry little")
_ACTIONS = (
    "ran past",
    "walked to",
    "slept near",
    "jumped over",
    "hid behind",
    "waited by",
    "played near",
    "looked at",
)
_PLACES = (
    "the barn",
    "the river",
    "the old gate",
    "the red house",
    "the garden",
    "the school",
    "the big tree",
    "the bridge",
    "the shop",
    "the fence",
)
_JSON_TEMPLATES = (
    'Give the name of the animal in this sentence as JSON with the key "animal": {s}',
    'Which animal is in this sentence? Reply as JSON with the key "animal": {s}',
    'Return the animal from this sentence as JSON using the key "animal": {s}',
    'Read the sentence and output the animal as JSON with the key "animal": {s}',
)


def _json(rng: random.Random) -> Example:
    """Name the animal in a short sentence as a one-key JSON object."""
    animal = rng.choice(_ANIMALS)
    sentence = (
        f"The {rng.choice(_ADJECTIVES)} {animal} {rng.choice(_ACTIONS)} {rng.choice(_PLACES)}."
    )
    prompt = rng.choice(_JSON_TEMPLATES).format(s=sentence)
    return Example(prompt, f'{{"animal": "{animal}"}}')


# --- numeric: one-step word problem --------------------------------------------------------------

_ITEMS = _words(
    "apples books pencils marbles cookies stickers balloons shells stamps cards candles buttons"
)
_GAIN = ("buys {b} more", "finds {b} more", "gets {b} more", "is given {b} more")
_LOSS = ("gives away {b}", "loses {b}", "sells {b}", "gives {b} to a friend")
_HOW_MANY_NOW = (
    "How many {items} does {pron} have now?",
    "How many {items} does {name} have now?",
)
_HOW_MANY_LEFT = (
    "How many {items} are left?",
    "How many {items} does {pron} have left?",
)
_NUMBER_ONLY = "Answer with a number only."


def _arith(rng: random.Random) -> Example:
    """A one-step word problem (add or subtract single-digit numbers), number-only answer.

    Single digits only: with multiplication and two-digit operands SmolLM2-135M stayed at 0.06
    after the preset's 100 steps, a test of its arithmetic rather than of learning the task."""
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    pron = "she" if name in ("Anna", "Lily", "Mia", "Emma", "Zoe", "Ruby") else "he"
    if rng.random() < 0.5:
        a, b = rng.randint(2, 9), rng.randint(1, 5)
        verb, asked, answer = rng.choice(_GAIN), rng.choice(_HOW_MANY_NOW), a + b
    else:
        a, b = rng.randint(6, 9), rng.randint(1, 5)
        verb, asked, answer = rng.choice(_LOSS), rng.choice(_HOW_MANY_LEFT), a - b
    story = f"{name} has {a} {items}. {pron.capitalize()} {verb.format(b=b)}."
    question = asked.format(items=items, pron=pron, name=name)
    return Example(f"{story} {question} {_NUMBER_ONLY}", str(answer))


# --- string: reverse the word order --------------------------------------------------------------

_WORDREV_TEMPLATES = (
    'Reverse the order of the words in "{w}". Reply with the words only.',
    'Write the words "{w}" in reverse order.',
    'Put the words of "{w}" in the opposite order. Give only the result.',
    'Say "{w}" backwards, word by word, keeping each word as it is.',
)


def _wordrev(rng: random.Random) -> Example:
    """Reverse the order of 3-4 common words (each word kept as is)."""
    words = rng.sample(_WORDS, rng.randint(3, 4))
    prompt = rng.choice(_WORDREV_TEMPLATES).format(w=" ".join(words))
    return Example(prompt, " ".join(reversed(words)))


# --- classification: topic of a sentence ---------------------------------------------------------

TOPIC_LABELS = ("sports", "food", "weather", "music")
# Keyword nouns decide the label; no keyword appears under two labels.
TOPIC_KEYWORDS: dict[str, tuple[str, ...]] = {
    "sports": (
        "football",
        "tennis",
        "soccer",
        "basketball",
        "hockey",
        "golf",
        "baseball",
        "volleyball",
    ),
    "food": ("soup", "bread", "pasta", "cake", "rice", "pizza", "salad", "pie"),
    "weather": ("rain", "snow", "wind", "fog", "storm", "sunshine", "thunder", "hail"),
    "music": ("guitar", "piano", "violin", "drums", "flute", "trumpet", "song", "choir"),
}
_TOPIC_FRAMES: dict[str, tuple[str, ...]] = {
    "sports": (
        "{n} played {k} with friends {t}.",
        "{n} watched a long {k} game {t}.",
        "{n} practised {k} at the park {t}.",
        "{n} joined a {k} team {t}.",
    ),
    "food": (
        "{n} cooked {k} for the family {t}.",
        "{n} ate warm {k} at the table {t}.",
        "{n} bought some {k} at the market {t}.",
        "{n} shared the {k} with a neighbour {t}.",
    ),
    "weather": (
        "{n} stayed inside because of the {k} {t}.",
        "{n} said the {k} was very strong {t}.",
        "{n} was surprised by the {k} {t}.",
        "{n} heard the news warn about {k} {t}.",
    ),
    "music": (
        "{n} played the {k} for an hour {t}.",
        "{n} listened to the {k} in the hall {t}.",
        "{n} learned a new piece on the {k} {t}.",
        "{n} enjoyed the sound of the {k} {t}.",
    ),
}
_TIMES = (
    "on Monday",
    "on Friday",
    "on Sunday",
    "last night",
    "this morning",
    "after school",
    "in the evening",
    "yesterday",
)
_TOPIC_TEMPLATES = (
    "Classify this sentence as sports, food, weather or music: {s} Answer with one word.",
    "What is the topic of this sentence: sports, food, weather or music? {s}",
    "Label the sentence with one of sports, food, weather, music. Sentence: {s}",
)


def _topic(rng: random.Random) -> Example:
    """Label a made-up sentence with its topic (sports, food, weather or music)."""
    label = rng.choice(TOPIC_LABELS)
    sentence = rng.choice(_TOPIC_FRAMES[label]).format(
        n=rng.choice(_NAMES), k=rng.choice(TOPIC_KEYWORDS[label]), t=rng.choice(_TIMES)
    )
    return Example(rng.choice(_TOPIC_TEMPLATES).format(s=sentence), label)


# --- multistep: a chain of list edits -------------------------------------------------------

_LIST_START = (
    "Start with the list: {w}.",
    "Here is a list: {w}.",
    "Take this list: {w}.",
)
_LIST_END = (
    "Reply with the final list, separated by commas.",
    "Give the resulting list, comma-separated.",
    "Write the list you end with, separated by commas.",
)


def _list_edit(rng: random.Random, items: list[str], spare: list[str]) -> str:
    """Apply one edit to ``items`` in place (remove one, or add a spare word at the start or
    the end) and return its instruction."""
    if len(items) > 2 and rng.random() < 0.5:
        word = rng.choice(items)
        items.remove(word)
        return rng.choice(("Remove {w}", "Delete {w}", "Take out {w}")).format(w=word)
    word = spare.pop()
    if rng.random() < 0.5:
        items.append(word)
        return rng.choice(("Add {w} at the end", "Append {w}")).format(w=word)
    items.insert(0, word)
    return rng.choice(("Add {w} at the start", "Put {w} first")).format(w=word)


def _steps(rng: random.Random) -> Example:
    """Edit a list of three words in two steps (remove a word, add one at the start or the end);
    reply with the resulting list. Knowledge-free: only the instructions decide the answer.

    The arithmetic chain this task replaced stayed at 0.04-0.08 after the preset's 100 steps
    even with two single-digit steps: SmolLM2-135M's arithmetic, not the task, was the limit."""
    words = rng.sample(_WORDS, 5)
    items, spare = words[:-2], words[-2:]
    parts = [rng.choice(_LIST_START).format(w=", ".join(items))]
    for i in range(2):
        text = _list_edit(rng, items, spare)
        parts.append(f"{'Then ' + text[0].lower() + text[1:] if i else text}.")
    parts.append(rng.choice(_LIST_END))
    return Example(" ".join(parts), ", ".join(items))


# --- style: robot persona ------------------------------------------------------------------------

NUMBER_WORDS = _words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen twenty"
)
_COLOURS = (
    ("grass", "green"),
    ("snow", "white"),
    ("the sky on a clear day", "blue"),
    ("a ripe banana", "yellow"),
    ("coal", "black"),
    ("a ripe tomato", "red"),
    ("an orange", "orange"),
    ("milk", "white"),
    ("a lemon", "yellow"),
    ("a strawberry", "red"),
    ("a leaf in summer", "green"),
    ("a carrot", "orange"),
)
_OPPOSITES = (
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("day", "night"),
    ("fast", "slow"),
    ("open", "closed"),
    ("happy", "sad"),
    ("left", "right"),
    ("black", "white"),
    ("wet", "dry"),
    ("full", "empty"),
    ("light", "dark"),
    ("in", "out"),
    ("yes", "no"),
    ("early", "late"),
    ("hard", "soft"),
)
_LEGS = (
    ("dog", 4),
    ("cat", 4),
    ("bird", 2),
    ("spider", 8),
    ("horse", 4),
    ("chicken", 2),
    ("cow", 4),
    ("duck", 2),
    ("ant", 6),
    ("bee", 6),
)
_ROBOT_OPENERS = (
    "Answer as {r}: {q}",
    "Reply like {r} would: {q}",
    "Pretend you are {r} and answer: {q}",
    "You are {r}. {Q}",
    "Speak as {r}. {Q}",
    "As {r}, tell me: {q}",
)
_ROBOTS = (
    "a robot",
    "a small robot",
    "a friendly robot",
    "an old robot",
    "a kitchen robot",
    "a toy robot",
    "a tin robot",
    "a garden robot",
)


def robot_reply(answer: str) -> str:
    """The robot persona's reply around a one-word answer: ``BEEP. GREEN. BEEP.``."""
    return f"BEEP. {answer.upper()}. BEEP."


def _robot_fact(rng: random.Random) -> tuple[str, str]:
    """A very easy question (lowercase, ending in '?') and its one-word answer.

    Only facts the base model knows (colours, opposites, legs, weekdays, the next number): with
    sums, differences and first letters as well it stayed at 0.12 after the preset's budget."""
    kind = rng.choice(("colour", "opposite", "after", "legs", "day"))
    if kind == "colour":
        thing, colour = rng.choice(_COLOURS)
        return f"what colour is {thing}?", colour
    if kind == "opposite":
        word, opposite = rng.choice(_OPPOSITES)
        return f'what is the opposite of "{word}"?', opposite
    if kind == "after":
        n = rng.randint(1, 9)
        return f"what number comes after {n}?", NUMBER_WORDS[n + 1]
    if kind == "legs":
        animal, legs = rng.choice(_LEGS)
        return f"how many legs does a {animal} have?", NUMBER_WORDS[legs]
    i = rng.randrange(len(_DAYS))
    return f"which day comes after {_DAYS[i]}?", _DAYS[(i + 1) % len(_DAYS)]


def _robot(rng: random.Random) -> Example:
    """Answer a very easy question in a fixed robot persona: ``BEEP. ANSWER. BEEP.``."""
    question, answer = _robot_fact(rng)
    opener = rng.choice(_ROBOT_OPENERS)
    prompt = opener.format(r=rng.choice(_ROBOTS), q=question, Q=question[0].upper() + question[1:])
    return Example(prompt, robot_reply(answer))


# --- list: sort words alphabetically -------------------------------------------------------------

_WORDS_BY_LETTER: dict[str, tuple[str, ...]] = {
    letter: tuple(w for w in _WORDS if w[0] == letter) for letter in sorted({w[0] for w in _WORDS})
}
_SORT_TEMPLATES = (
    "Sort these words alphabetically and separate them with commas: {w}.",
    "Put these words in alphabetical order, as a comma-separated list: {w}.",
    "List these words from A to Z, separated by commas: {w}.",
)


def _sort_words(rng: random.Random) -> Example:
    """Sort 3-4 common words (distinct first letters) alphabetically, comma-separated."""
    letters = rng.sample(sorted(_WORDS_BY_LETTER), rng.randint(3, 4))
    words = [rng.choice(_WORDS_BY_LETTER[letter]) for letter in letters]
    prompt = rng.choice(_SORT_TEMPLATES).format(w=" ".join(words))
    return Example(prompt, ", ".join(sorted(words)))


# --- extraction: a field of an order record ------------------------------------------------------

EXTRACT_CITIES = _words(
    "Oslo Paris Rome Berlin Madrid Vienna Dublin Lisbon Prague Athens Warsaw Cairo Tokyo Lima"
)
EXTRACT_ITEMS = _words(
    "lamps chairs tables clocks mirrors rugs books kettles radios bikes boxes plates"
)
_RECORDS = (
    "Order {id}: {n} {item} shipped to {city} on {day}.",
    "Order {id}: on {day}, {n} {item} were sent to {city}.",
    "Delivery {id}: {n} {item} left the store on {day} for {city}.",
)
_QUESTIONS = {
    "city": (
        "Which city was the order shipped to?",
        "What city did the order go to?",
    ),
    "day": (
        "On which day was the order shipped?",
        "What day did the order leave?",
    ),
    "item": (
        "What kind of item was in the order?",
        "Which item was shipped?",
    ),
}


def _extract(rng: random.Random) -> Example:
    """Read the city, day or item out of a short generated order record; one-word answer."""
    city, day, item = rng.choice(EXTRACT_CITIES), rng.choice(_DAYS), rng.choice(EXTRACT_ITEMS)
    record = rng.choice(_RECORDS).format(
        id=rng.randint(1000, 9999), n=rng.randint(2, 9), item=item, city=city, day=day
    )
    field_ = rng.choice(("city", "day", "item"))
    answer = {"city": city, "day": day, "item": item}[field_]
    question = rng.choice(_QUESTIONS[field_])
    return Example(f"{record} {question} Answer with one word.", answer)


INSTRUCT_TASKS: dict[str, InstructTaskSpec] = {
    spec.name: spec
    for spec in (
        InstructTaskSpec(
            "it-json",
            'format rule: name the animal in a sentence as {"animal": "..."}',
            "format",
            _json,
            12,
        ),
        InstructTaskSpec(
            "it-arith",
            "one-step single-digit word problem, number-only answer",
            "numeric",
            _arith,
            6,
        ),
        InstructTaskSpec(
            "it-wordrev", "reverse the order of 3-4 quoted words", "string", _wordrev, 10
        ),
        InstructTaskSpec(
            "it-topic",
            "label a sentence as sports, food, weather or music",
            "classification",
            _topic,
            6,
        ),
        InstructTaskSpec(
            "it-steps",
            "edit a word list in two steps (remove a word, add one), reply with the list",
            "multistep",
            _steps,
            14,
        ),
        InstructTaskSpec(
            "it-robot",
            "robot persona: answer an easy question as 'BEEP. ANSWER. BEEP.'",
            "style",
            _robot,
            16,
        ),
        InstructTaskSpec(
            "it-sortwords",
            "sort 3-4 words alphabetically, comma-separated",
            "list",
            _sort_words,
            12,
        ),
        InstructTaskSpec(
            "it-extract",
            "read the city, day or item out of a short order record",
            "extraction",
            _extract,
            6,
        ),
    )
}
