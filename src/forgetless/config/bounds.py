"""Sizes a run cannot hold, refused before anything is loaded; sizes that make it slow, warned.

The memory estimate counts what a run keeps of its own making: the built-in tasks' examples
(every task and probe is built up front and kept), the encoded training set, the tiny base's
pretraining and weights, and the results matrices. JSONL and Hugging Face tasks are left out:
their ``n_train`` only caps the rows the file has. Activations and a downloaded model's weights
depend on the model, which is not loaded yet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from forgetless.config.schema import RunConfig, TaskConfig, probe_names
from forgetless.core.paths import read_stripped
from forgetless.errors import ConfigError

EXAMPLE_BYTES = 704
"""A built-in example as built, with its share of the set of prompts that keeps the draws
distinct: at most 642 bytes measured over every built-in task (addmc at n_train 300, whose
choices add a tuple; 594 at 2000), at most 492 for the others; about 10% above the largest."""
FEATURE_BYTES = 320
TOKEN_BYTES = 48
"""An encoded example: about 310 bytes of dict and lists, then per token two list slots and an
int object (a token id above 256 is an object of its own, 28 bytes); measured 13 per token with
the character tokenizer, whose ids are all small."""
BUILTIN_TOKENS = 256
"""The most tokens a built-in example can take: the longest is 168 characters (it-steps), at
most one token each, plus a chat template's turn markers."""
RESULT_CELL_BYTES = 320
"""One (row, task) cell of the results: its accuracy and log-likelihood floats (66 bytes) and
the indented JSON written after every task (222 bytes at its peak); measured 288 at 600 tasks."""
PARAM_BYTES = 16
"""A trained float32 weight: itself, its gradient and AdamW's two moments."""
CHAR_VOCAB = 128
"""At least the built-in character tokenizer's vocabulary (printable ASCII and a few specials)."""
MANY_TASKS = 50
"""Above this many tasks, the evaluations (every task and probe after every task) dominate."""
FIXED_SIZE_PROBES = ("gk-mc", "gk-short", "chat-format")
"""Built-in probes over the shipped question set, whatever n_train says (``tasks.general``'s
``GENERAL_PROBES``, checked equal by a test)."""


@dataclass(frozen=True)
class Need:
    """Memory a run needs because of one config place."""

    place: str
    what: str
    bytes: int


def machine_memory() -> int | None:
    """The most memory this process can have: physical memory, or a smaller cgroup limit."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    limit = _read_int(Path("/sys/fs/cgroup/memory.max"))
    return min(total, limit) if limit else total


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo: what the machine can give now without swapping."""
    try:
        lines = Path("/proc/meminfo").read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _read_int(path: Path) -> int | None:
    text = read_stripped(path, encoding="ascii")
    return int(text) if text is not None and text.isdigit() else None  # "max": no limit


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def feature_bytes(max_length: int) -> int:
    return FEATURE_BYTES + TOKEN_BYTES * min(max_length, BUILTIN_TOKENS)


def _sized(section: str, tasks: list[TaskConfig]) -> list[tuple[str, TaskConfig]]:
    """The built-in tasks whose size the config sets, with their place (``tasks.3``)."""
    return [
        (f"{section}.{i}", t)
        for i, t in enumerate(tasks)
        if t.builtin is not None and t.builtin not in FIXED_SIZE_PROBES
    ]


def _count(cfg: RunConfig, place: str, task: TaskConfig, key: str) -> tuple[int, str]:
    """A task's ``n_train`` or ``n_eval`` and the place that sets it: its own, or ``eval``'s."""
    own: int | None = getattr(task, key)
    return (own, f"{place}.{key}") if own else (getattr(cfg.eval, key), f"eval.{key}")


def _example_needs(cfg: RunConfig) -> dict[str, Need]:
    """The examples of every built-in task and probe, which are all built up front and kept."""
    probes = [p for p in cfg.probes if isinstance(p, TaskConfig)]
    counts: dict[str, tuple[int, int]] = {}  # place -> (examples per task, tasks)
    for place, task in _sized("tasks", cfg.tasks) + _sized("probes", probes):
        for key in ("n_train", "n_eval"):
            n, where = _count(cfg, place, task, key)
            counts[where] = (n, counts.get(where, (n, 0))[1] + 1)
    needs = {}
    for where, (n, k) in counts.items():
        what = f"{n} examples per task ({k} built-in tasks)" if k > 1 else f"{n} examples"
        needs[where] = Need(where, what, n * k * EXAMPLE_BYTES)
    return needs


def _encoding_need(cfg: RunConfig, needs: dict[str, Need]) -> None:
    """The runner keeps one task's encoded training set while it encodes the next."""
    sizes = [_count(cfg, place, task, "n_train") for place, task in _sized("tasks", cfg.tasks)]
    largest = sorted(sizes, reverse=True)[:2]
    if not largest:
        return
    # unset, max_length is the longest example: at most BUILTIN_TOKENS for built-in tasks
    held = sum(n for n, _ in largest) * feature_bytes(cfg.train.max_length or BUILTIN_TOKENS)
    place = largest[0][1]
    needs[place] = Need(place, needs[place].what, needs[place].bytes + held)


def _base_needs(cfg: RunConfig) -> list[Need]:
    """The built-in tiny base: its pretraining mixture, all encoded at once, and its weights."""
    if cfg.model.name_or_path is not None:
        return []
    p, tiny = cfg.model.pretrain, cfg.model.tiny
    each = EXAMPLE_BYTES + feature_bytes(tiny.max_position)
    mixture = Need(
        "model.pretrain.n_train",
        f"{p.n_train} pretraining examples per task ({len(p.tasks)} tasks)",
        p.n_train * len(p.tasks) * each,
    )
    h, kv = tiny.hidden_size, tiny.hidden_size // tiny.num_heads * tiny.num_kv_heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * tiny.intermediate_size
    params = 2 * CHAR_VOCAB * h + tiny.num_layers * layer
    weights = Need("model.tiny", f"a tiny model of {params} weights", params * PARAM_BYTES)
    return [mixture, weights]


def _results_need(cfg: RunConfig) -> Need:
    tasks, columns = len(cfg.tasks), len(cfg.tasks) + len(probe_names(cfg.probes))
    what = f"{tasks} tasks ({tasks + 1} result rows of {columns} columns)"
    return Need("tasks", what, (tasks + 1) * columns * RESULT_CELL_BYTES)


def memory_needs(cfg: RunConfig) -> list[Need]:
    """What the run's own data takes, by the config place that sets each part."""
    needs = _example_needs(cfg)
    _encoding_need(cfg, needs)
    return [*needs.values(), *_base_needs(cfg), _results_need(cfg)]


def _biggest(needs: list[Need]) -> tuple[Need, int]:
    return max(needs, key=lambda n: n.bytes), sum(n.bytes for n in needs)


def check_fits(cfg: RunConfig, source: str, machine: int | None = None) -> None:
    """Refuse a config whose own data would take more memory than the machine has."""
    machine = machine if machine is not None else machine_memory()
    worst, total = _biggest(memory_needs(cfg))
    if machine is not None and total > machine:
        raise ConfigError(
            f"{source}: {worst.place}: {worst.what} would need about {human_bytes(total)} of "
            f"memory; the machine has {human_bytes(machine)}"
        )


def size_warnings(cfg: RunConfig, source: str) -> list[str]:
    """Sizes that fit but will hurt: more memory than is free now, a quadratic evaluation."""
    available = available_memory()
    worst, total = _biggest(memory_needs(cfg))
    out = []
    if available is not None and total > available:
        out.append(
            f"warning: {source}: {worst.place}: {worst.what} would need about "
            f"{human_bytes(total)} of memory; {human_bytes(available)} is free now"
        )
    tasks = len(cfg.tasks)
    if tasks > MANY_TASKS:
        rows, columns = tasks + 1, tasks + len(probe_names(cfg.probes))
        out.append(
            f"warning: {source}: tasks: {tasks} tasks: every task and probe is evaluated after "
            f"every task, {rows} rows x {columns} = {rows * columns} evaluations of up to "
            f"{cfg.eval.n_eval} examples each, growing with the square of the task count"
        )
    return out
