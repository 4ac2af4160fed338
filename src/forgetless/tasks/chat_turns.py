"""Chat turns that what is trained leaves out: said once per task, never dropped silently.

Without a chat template only the last user turn and the answer are encoded
(``formatting.encode_prompt``), so a system turn or earlier turns go; a template may also render
a conversation without some turn (many drop or fold the system turn). A template that refuses a
conversation outright (raises) is a one-line error naming the task and the example.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from jinja2 import TemplateError

from forgetless.errors import DataError
from forgetless.tasks.base import Example, Message, Task


def _untemplated_drops(turns: tuple[Message, ...]) -> list[str]:
    users = [i for i, t in enumerate(turns[:-1]) if t["role"] == "user"]
    kept = {len(turns) - 1, *users[-1:]}
    return [t["role"] for i, t in enumerate(turns) if i not in kept]


def dropped_turns(tokenizer: Any, example: Example) -> list[str]:
    """The roles of ``example``'s chat turns whose text is not in what is encoded."""
    if example.messages is None:
        return []
    if not getattr(tokenizer, "chat_template", None):
        return _untemplated_drops(example.messages)
    text = tokenizer.apply_chat_template([dict(m) for m in example.messages], tokenize=False)
    return [
        m["role"]
        for m in example.messages
        if m["content"].strip() and m["content"].strip() not in text
    ]


def _role_words(roles: Counter[str]) -> str:
    names = sorted(roles)
    joined = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"{joined} turn{'s' if len(names) > 1 else ''}"


def _dropped_counts(task: Task, tokenizer: Any) -> tuple[Counter[str], int, int]:
    roles: Counter[str] = Counter()
    examples = [e for e in (*task.train, *task.eval) if e.messages is not None]
    hit = 0
    for index, example in enumerate(examples):
        try:
            dropped = dropped_turns(tokenizer, example)
        except TemplateError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DataError(
                f"task {task.name!r}: chat example {index}: the tokenizer's chat template "
                f"refuses it ({first})"
            ) from None
        roles.update(set(dropped))
        hit += bool(dropped)
    return roles, hit, len(examples)


def dropped_turns_warning(task: Task, tokenizer: Any) -> str | None:
    """One warning line when some of ``task``'s chat turns are left out of what is encoded."""
    roles, hit, total = _dropped_counts(task, tokenizer)
    if not hit:
        return None
    why = (
        "the tokenizer's chat template drops it"
        if getattr(tokenizer, "chat_template", None)
        else "the tokenizer has no chat template: only the last user turn and the answer are "
        "encoded"
    )
    verb = "are" if len(roles) > 1 else "is"
    left_out = f"the {_role_words(roles)} of {hit} of {total} chat examples {verb} left out"
    return f"warning: task {task.name!r}: {left_out} ({why})"
