"""How a run spreads over processes, chosen once at start-up: one process, data-parallel (DDP),
sharded (FSDP2) or DeepSpeed ZeRO-1/2, each through accelerate (``core.distributed``)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rich.console import Console

from forgetless.config.schema import RunConfig
from forgetless.contract.method import Method
from forgetless.core import distributed, registry, sharding
from forgetless.errors import ConfigError
from forgetless.models.finetuner import Finetuner


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def task_seed(seed: int, index: int) -> int:
    """Each task trains under its own seed, so a resumed run replays what a full run does."""
    return seed * 1000 + index


@dataclass(frozen=True)
class ScaleOut:
    """The launch's layout (``single``, ``ddp``, ``fsdp2``, ``zero1``/``zero2``) and what it asks
    of a run: the checks before training, the split of the model, the method's state reduced
    over the processes and restored onto the shards."""

    layout: str
    processes: int

    @classmethod
    def at_start(cls) -> ScaleOut:
        return cls(distributed.layout(), distributed.world_size())

    @property
    def sharded(self) -> bool:
        return distributed.sharded()

    def prepare(
        self, cfg: RunConfig, method: Method, finetuner: Finetuner, tasks: int, console: Console
    ) -> None:
        """Refuse what the layout cannot run, then split the model where it is sharded."""
        if self.sharded:
            self._check(registry.sharding_rule_broken(type(method), *_sharding_args(cfg)))
            self._attach_adapters(cfg.seed, finetuner, tasks)
            sharding.shard_model(finetuner.model)
            console.print(
                f"FSDP2: the model is sharded over {self.processes} processes", highlight=False
            )
        if self.layout.startswith("zero"):
            every = cfg.train.checkpoint_every
            self._check(registry.zero_rule_broken(type(method), cfg.budget is not None, every))

    @staticmethod
    def _check(broken: str | None) -> None:
        if broken:
            raise ConfigError(broken)

    @staticmethod
    def _attach_adapters(seed: int, finetuner: Finetuner, tasks: int) -> None:
        """LoRA adapters attached before the split, each under the seed its task starts with
        (so it starts as a one-process run's does), every random state left as it was."""
        states = random.getstate(), np.random.get_state()
        for index in finetuner.tasks_attached_before_split(tasks):
            with torch.random.fork_rng():
                seed_everything(task_seed(seed, index))
                finetuner.attach_before_split(index)
        random.setstate(states[0])
        np.random.set_state(states[1])

    def reduced_state(self, method: Method) -> dict[str, Any]:
        """The method's state reduced over processes by its ``reduce_ops``; every process then
        holds what is saved, so a resumed run and an uninterrupted one go on alike."""
        state = method.state_dict()
        if self.sharded:  # each process computed its shards from the same data
            return dict(sharding.gather_state(state))
        if self.processes == 1 or not method.reduce_ops:
            return state
        reduced: dict[str, Any] = distributed.reduce_state(state, method.reduce_ops)
        method.load_state_dict(reduced)
        return reduced

    def restored_state(self, state: dict[str, Any], finetuner: Finetuner) -> dict[str, Any]:
        """A saved method state, split like the model where it is sharded."""
        return sharding.shard_state_like(state, finetuner.model) if self.sharded else state

    def record(self) -> dict[str, Any]:
        return {"processes": self.processes, "parallel": self.layout}


def _sharding_args(cfg: RunConfig) -> tuple[str, Any, str]:
    return cfg.finetune.mode, cfg.method, cfg.finetune.lora.regime
