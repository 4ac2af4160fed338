"""Experience replay: a reservoir-sampled episodic memory mixed into every training batch."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field

from forgetless.contract.method import (
    Capability,
    Knob,
    Method,
    MethodConfig,
    MethodState,
    Paper,
    StepContext,
    TaskEndContext,
    declare_method,
)
from forgetless.tasks.formatting import Features

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


def replay_count(batch_size: int, ratio: float, buffer_len: int) -> int:
    """How many of a batch's examples come from the buffer (none while it is empty)."""
    if buffer_len == 0:
        return 0
    return min(batch_size, round(ratio * batch_size))


def mix_batch(
    features: Sequence[Features], buffer: Sequence[Features], ratio: float, rng: random.Random
) -> list[Features]:
    """Replace ``round(ratio * len(features))`` of ``features`` with examples drawn from ``buffer``.

    The batch is already a random draw of the current task, so its first examples are kept and the
    rest replaced; buffer examples are drawn without replacement when the buffer is big enough.
    """
    k = replay_count(len(features), ratio, len(buffer))
    if k == 0:
        return list(features)
    drawn = rng.sample(list(buffer), k) if k <= len(buffer) else rng.choices(list(buffer), k=k)
    return [*features[: len(features) - k], *drawn]


def seeded_rng(*parts: int | str) -> random.Random:
    """A ``random.Random`` seeded from ``parts``: stable across processes and Python versions."""
    return random.Random(":".join(str(p) for p in parts))


def copy_features(features: Features) -> Features:
    return {key: [int(v) for v in values] for key, values in features.items()}


# --- hook wiring -------------------------------------------------------------------------------


class ReplayConfig(MethodConfig):
    name: Literal["replay"] = Field("replay", description="Experience replay.")
    buffer_size: int = Field(
        200, ge=0, description="Examples kept in the episodic memory, over all past tasks."
    )
    ratio: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="Fraction of each micro-batch replaced by memory examples (CLEAR uses 0.5).",
    )
    seed: int = Field(
        0,
        ge=0,
        lt=2**32,
        description="Seed of the reservoir and the replay draws (with the run's).",
    )


@declare_method(
    "replay",
    ReplayConfig,
    capabilities={Capability.BATCH_TRANSFORM, Capability.TASK_END, Capability.STATE},
    paper=Paper("Experience Replay for Continual Learning", "Rolnick et al.", 2019, "NeurIPS"),
)
class Replay(Method[ReplayConfig]):
    """Experience replay with a reservoir-sampled episodic memory.

    Rolnick et al. 2019, "Experience Replay for Continual Learning" (NeurIPS): mix stored
    examples of past tasks into the training batches of the current one. Chaudhry et al. 2019,
    "On Tiny Episodic Memories in Continual Learning": a small memory filled by reservoir sampling
    over the whole stream is a strong baseline.

    When a task ends, its tokenized training examples stream into the reservoir. Every micro-batch
    of a later task then has ``round(ratio * batch_size)`` of its examples replaced by memory
    examples, drawn from an RNG seeded by (run seed, ``seed``, task, step, micro-batch), so a
    resumed run replays exactly what an uninterrupted one does. The memory and the reservoir's
    count are the method's state.
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

    def transform_batch(self, features: list[Features], ctx: StepContext) -> list[Features]:
        key = (ctx.task.task_index, ctx.step)
        self._micro = self._micro + 1 if key == self._step_key else 0  # grad-accum micro-batches
        self._step_key = key
        rng = seeded_rng("replay", ctx.task.run.seed, self.config.seed, *key, self._micro)
        return mix_batch(features, self.buffer, self.config.ratio, rng)

    def on_task_end(self, ctx: TaskEndContext) -> None:
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
