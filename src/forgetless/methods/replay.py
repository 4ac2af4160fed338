"""Experience replay: a reservoir-sampled episodic memory of past tasks, and general data from
outside the sequence, mixed into every training batch."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from forgetless.config.schema import EvalConfig, HFSource, JsonlSource, TaskConfig
from forgetless.contract.method import (
    Capability,
    Knob,
    Method,
    MethodConfig,
    MethodState,
    StepContext,
    TaskContext,
    TaskEndContext,
    declare_method,
)
from forgetless.core.fields import Count, Fraction
from forgetless.errors import DataError
from forgetless.methods.papers import cite
from forgetless.strict import StrictModel
from forgetless.tasks.base import Example
from forgetless.tasks.formatting import Features, encode_training_set
from forgetless.tasks.general import prose_paragraphs
from forgetless.tasks.loaders import build_task

# --- pure math / data -------------------------------------------------------------------------


def reservoir_update(
    buffer: Sequence[Features],
    seen: int,
    items: Iterable[Features],
    capacity: int,
    rng: random.Random,
) -> tuple[list[Features], int]:
    """Reservoir sampling (Vitter's algorithm R) of ``items`` into ``buffer``.

    ``seen`` counts every item offered so far, over all calls; after the update each of those
    items is in the buffer with probability ``min(1, capacity / seen)``. Returns a new buffer and
    the new count; the input buffer is left untouched.
    """
    out = list(buffer)
    for item in items:
        seen += 1
        if len(out) < capacity:
            out.append(item)
        else:
            slot = rng.randrange(seen)
            if slot < capacity:
                out[slot] = item
    return out, seen


def replay_count(batch_size: int, ratio: float, buffer_len: int, rng: random.Random) -> int:
    """How many of a batch's examples come from the buffer (none while it is empty).

    ``ratio * batch_size`` when that is whole; else rounded down or up at random, up with the
    fractional part's probability, so that every share is kept on average: rounding to the
    nearest would replay nothing at all below half an example per batch (6.25% of 8 rows).
    A whole count takes no draw from ``rng``.
    """
    if buffer_len == 0:
        return 0
    share = ratio * batch_size
    if abs(share - round(share)) < 1e-9:
        return min(batch_size, round(share))
    whole = math.floor(share)
    return min(batch_size, whole + int(rng.random() < share - whole))


def mix_batch(
    features: Sequence[Features], buffer: Sequence[Features], ratio: float, rng: random.Random
) -> list[Features]:
    """Replace ``ratio * len(features)`` of ``features`` (``replay_count``) with examples drawn
    from ``buffer``.

    The batch is already a random draw of the current task, so its first examples are kept and the
    rest replaced; buffer examples are drawn without replacement when the buffer is big enough.
    """
    return mix_sources(features, [(buffer, ratio)], rng)


def mix_sources(
    features: Sequence[Features],
    pools: Sequence[tuple[Sequence[Features], float]],
    rng: random.Random,
) -> list[Features]:
    """Replace a share of ``features`` with draws from each ``(pool, ratio)`` in turn.

    Pool ``i`` gets ``ratio_i * len(features)`` slots (``replay_count``), capped by
    the slots still free; the current task's first examples fill the rest, then each pool's
    draws follow in order (without replacement when the pool is big enough).
    """
    free, counts = len(features), []
    for pool, ratio in pools:
        counts.append(min(free, replay_count(len(features), ratio, len(pool), rng)))
        free -= counts[-1]
    out = list(features[:free])
    for (pool, _), k in zip(pools, counts, strict=True):
        if k:
            out += rng.sample(list(pool), k) if k <= len(pool) else rng.choices(list(pool), k=k)
    return out


def seeded_rng(*parts: int | str) -> random.Random:
    """A ``random.Random`` seeded from ``parts``: stable across processes and Python versions."""
    return random.Random(":".join(str(p) for p in parts))


def copy_features(features: Features) -> Features:
    return {key: [int(v) for v in values] for key, values in features.items()}


# --- general data ------------------------------------------------------------------------------

PROSE = "prose"
PROSE_HELD_OUT: int = EvalConfig.model_fields["prose_kl_paragraphs"].default
"""The first prose paragraphs, on which a run (``eval.prose_kl_paragraphs`` at its default) and
``forgetless check`` measure KL to the base: never replayed, so that KL stays held out."""
DATASET_FILES = ("*.jsonl", "*.json", "*.parquet", "*.csv", "*.arrow")


def general_source_problem(source: str) -> str | None:
    """Why ``source`` cannot be read as general data, or None: ``prose``, a JSONL file, or a
    folder holding a ``save_to_disk`` dataset or data files."""
    if source == PROSE:
        return None
    path = Path(source).expanduser()
    if path.is_file():
        return None
    if not path.is_dir():
        return f"no such file or folder: {path} (or {PROSE!r}, the built-in prose corpus)"
    saved = (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    if saved or any(next(path.rglob(pattern), None) for pattern in DATASET_FILES):
        return None
    return f"{path} holds no dataset (a save_to_disk folder, or json/jsonl/parquet/csv files)"


def read_general_examples(source: str, limit: int) -> list[Example]:
    """The first ``limit`` examples of a JSONL file or a dataset folder, read by the task
    loaders (prompt/completion, chat ``messages`` or multiple-choice records)."""
    path = Path(source).expanduser()
    if path.is_file():
        task = TaskConfig(name="general", jsonl=JsonlSource(train=path, eval=path))
    else:  # the whole train split (also taken as the eval split, which nothing reads)
        task = TaskConfig(name="general", hf=HFSource(path=str(path), eval_split="train"))
    return build_task(task, EvalConfig(n_eval=1, n_train=limit), seed=0).train


def encode_plain_text(tokenizer: Any, texts: Iterable[str], max_length: int) -> list[Features]:
    """Plain text with the loss on every token (language modelling, no chat template), each cut
    to ``max_length`` tokens; a text under two tokens teaches nothing and is left out."""
    out = []
    for text in texts:
        ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]][:max_length]
        if len(ids) >= 2:
            out.append({"input_ids": ids, "labels": list(ids)})
    return out


def general_features(source: str, tokenizer: Any, max_length: int, limit: int) -> list[Features]:
    """General data as training features: the prose corpus past its held-out paragraphs as plain
    text, or a file's or folder's examples with the completion-only loss of a task."""
    if source == PROSE:
        paragraphs = prose_paragraphs()[PROSE_HELD_OUT:][:limit]
        features = encode_plain_text(tokenizer, paragraphs, max_length)
    else:
        examples = read_general_examples(source, limit)
        where = f"method.general.source {source}:"
        features, _ = encode_training_set(tokenizer, examples, max_length, where)
    if not features:
        raise DataError(f"method.general.source {source}: no example to replay")
    return features


# --- hook wiring -------------------------------------------------------------------------------


class GeneralReplay(StrictModel):
    """Where general data comes from and what share of each batch it takes."""

    source: str
    """'prose' (the shipped prose corpus, less the paragraphs KL is measured on), a JSONL file
    (prompt/completion or messages per line), or a dataset folder (datasets save_to_disk, or
    json/jsonl/parquet/csv files)."""
    ratio: float = Field(0.25, gt=0.0, le=1.0)
    """Fraction of each micro-batch replaced by general data."""
    max_examples: Count = 1000
    """General examples kept to draw from (the source's first ones)."""

    @field_validator("source")
    @classmethod
    def _readable(cls, value: str) -> str:
        problem = general_source_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


class ReplayConfig(MethodConfig):
    name: Literal["replay"] = "replay"
    """Experience replay."""
    buffer_size: int = Field(200, ge=0)
    """Examples kept in the episodic memory, over all past tasks."""
    ratio: Fraction = 0.25
    """Fraction of each micro-batch replaced by memory examples (CLEAR uses 0.5)."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seed of the reservoir and the replay draws (with the run's)."""
    past_tasks: bool = True
    """Replay the memory of past tasks (false: general data only)."""
    general: GeneralReplay | None = None
    """General data from outside the sequence, mixed into every batch beside or instead of past
    tasks: {source: prose|PATH, ratio: 0.25}."""

    @model_validator(mode="after")
    def _something_to_replay(self) -> ReplayConfig:
        if not self.past_tasks and self.general is None:
            raise ValueError("past_tasks: false needs general: {source: ...}; nothing to replay")
        if self.past_tasks and self.general and self.ratio + self.general.ratio > 1:
            raise ValueError(
                f"ratio {self.ratio} + general.ratio {self.general.ratio} exceed the whole batch"
            )
        return self


@declare_method(
    ReplayConfig,
    capabilities={Capability.BATCH_TRANSFORM, Capability.TASK_END, Capability.STATE},
    paper=cite("rolnick2019"),
)
class Replay(Method[ReplayConfig]):
    """Experience replay with a reservoir-sampled episodic memory.

    Rolnick et al. 2019, "Experience Replay for Continual Learning" (NeurIPS): mix stored
    examples of past tasks into the training batches of the current one. Chaudhry et al. 2019,
    "On Tiny Episodic Memories in Continual Learning": a small memory filled by reservoir sampling
    over the whole stream is a strong baseline.

    When a task ends, its tokenized training examples stream into the reservoir. Every micro-batch
    of a later task then has ``ratio * batch_size`` of its examples replaced by memory examples
    (rounded at random when not whole: ``replay_count``), drawn from an RNG seeded by (run seed,
    ``seed``, task, step, micro-batch), so a resumed run replays exactly what an uninterrupted
    one does. The memory and the reservoir's count are the method's state.

    ``general`` mixes data from outside the sequence (the shipped prose, a JSONL file, a dataset
    folder) into every batch from the first task on, at its own ratio, beside the memory or, with
    ``past_tasks: false``, instead of it: the replay of pretraining-like data that Ibrahim et al.
    2024, "Simple and Scalable Strategies to Continually Pre-train Large Language Models"
    (arXiv:2403.08763), find keeps forgetting down. The general examples are read and encoded on
    the first batch and drawn from the same seeded RNG after the memory's; they are no state,
    since the source gives them back. The bench's ``replay-general`` is this with the prose.
    """

    unsharded = None  # its memory holds examples, not weights: runs on FSDP2 shards
    knob = Knob(
        "ratio", keeps_more="higher", low=0.01, high=0.95
    )  # budget: the share of each batch replayed
    smoke: ClassVar[dict[str, Any]] = {"buffer_size": 16, "ratio": 0.5}

    def __init__(self, config: ReplayConfig) -> None:
        super().__init__(config)
        self.buffer: list[Features] = []
        self.seen = 0
        self._step_key: tuple[int, int] | None = None
        self._micro = 0
        self.general: list[Features] | None = None
        """The encoded general examples (read on the first batch)."""

    def transform_batch(self, features: list[Features], ctx: StepContext) -> list[Features]:
        key = (ctx.task.task_index, ctx.step)
        self._micro = self._micro + 1 if key == self._step_key else 0  # grad-accum micro-batches
        self._step_key = key
        rng = seeded_rng("replay", ctx.task.run.seed, self.config.seed, *key, self._micro)
        pools = [(self.buffer, self.config.ratio)] if self.config.past_tasks else []
        if self.config.general is not None:
            pools.append((self._general_pool(ctx.task), self.config.general.ratio))
        return mix_sources(features, pools, rng)

    def _general_pool(self, task: TaskContext) -> list[Features]:
        general = self.config.general
        if self.general is None and general is not None:
            self.general = general_features(
                general.source, task.tokenizer, task.run.max_length, general.max_examples
            )
        return self.general or []

    def on_task_end(self, ctx: TaskEndContext) -> None:
        if not self.config.past_tasks:
            return
        task = ctx.task
        rng = seeded_rng("reservoir", task.run.seed, self.config.seed, task.task_index)
        items = (copy_features(f) for f in task.train_features)
        self.buffer, self.seen = reservoir_update(
            self.buffer, self.seen, items, self.config.buffer_size, rng
        )

    def state_dict(self) -> MethodState:
        return {"buffer": [copy_features(f) for f in self.buffer], "seen": self.seen}

    def load_state_dict(self, state: MethodState) -> None:
        buffer: list[dict[str, Any]] = list(state.get("buffer", []))
        self.buffer = [copy_features(f) for f in buffer]
        self.seen = int(state.get("seen", 0))
