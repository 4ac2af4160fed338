"""DeepSpeed ZeRO stages 1 and 2, prepared by accelerate from a standard launch config.

Under ZeRO-1 and 2 every process still holds whole weights; what is split is the optimizer's
state (and, at stage 2, the reduced gradients). The engine owns the gradient reduction, the
clipping and the optimizer step; the loop keeps what it does around them. Two facts shape this:

- The engine keeps its own float32 copy of each process's partition and copies it back into
  the model after every step, so a weight the loop writes between steps (an update gate) must
  be copied into that partition too (``refresh_fp32_params``), or the next step undoes it.
- The engine's gradient hooks stay on the parameters until it is destroyed, so each training
  loop gets its own engine and destroys it when the loop ends: a Fisher or a relevance map
  computed after the loop stays local, as it does under DDP.

Stage 3 splits the weights themselves; methods read and write whole weights between steps, so it
is refused (FSDP2 is the sharded path).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from forgetless.core.sharding import truthy
from forgetless.errors import ConfigError

SUPPORTED_STAGES = (1, 2)


def launched() -> bool:
    """Whether ``accelerate launch`` started this process with DeepSpeed."""
    return truthy(os.environ.get("ACCELERATE_USE_DEEPSPEED", ""))


def launch_env(rank: int, world: int, port: int, stage: int) -> dict[str, str]:
    """The environment ``accelerate launch --use_deepspeed --zero_stage STAGE`` gives process
    ``rank`` on one machine (CPU backend): for processes started some other way."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage),
        "DS_ACCELERATOR": "cpu",
    }


def plugin() -> Any:
    """accelerate's DeepSpeed plugin, read from the launch (its flags or its config file)."""
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin()


def stage() -> int:
    """The launch's ZeRO stage (its flag, else its config file's)."""
    return int(plugin().zero_stage)


def check_launch(stage: int) -> None:
    """Stages 1 and 2 run where deepspeed is installed; anything else is refused with why."""
    if stage == 3:
        raise ConfigError(
            "accelerate config: DeepSpeed ZeRO-3 is not supported: it splits the weights, which "
            "methods read and write whole between steps; use ZeRO-1/2 or an FSDP version 2 "
            "config (see examples/accelerate/)"
        )
    if stage not in SUPPORTED_STAGES:
        raise ConfigError(f"accelerate config: DeepSpeed ZeRO stage {stage}: use stage 1 or 2")
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            "accelerate config: distributed_type DEEPSPEED needs deepspeed, which is not "
            "installed (make deepspeed; see docs/scale-out.md)"
        )


def ds_settings(batch_size: int, world: int, max_grad_norm: float | None) -> dict[str, Any]:
    """The engine's batch bookkeeping and clipping for one optimizer step of the loop: one
    micro-batch per step (the loop accumulates its own), each process a share of the batch."""
    micro = max(1, math.ceil(batch_size / world))
    clip = max_grad_norm if max_grad_norm is not None and math.isfinite(max_grad_norm) else 0.0
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro * world,
        "gradient_clipping": clip,
    }


@dataclass
class ZeroEngine:
    """One loop's DeepSpeed engine: forward through ``module``, then ``backward`` for each
    micro-batch and one ``step``."""

    engine: Any

    @property
    def module(self) -> nn.Module:
        return self.engine  # type: ignore[no-any-return]

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate ``loss``'s gradients; the engine reduces them for the step's last one."""
        self.engine.set_gradient_accumulation_boundary(is_boundary=last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        """Clip, step and zero the gradients; the step's global gradient norm (inf when the
        engine found it non-finite and skipped the step)."""
        self.engine.step()
        if not self.engine.was_step_applied():
            return math.inf
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def weights_written(self) -> None:
        """Copy weights the loop wrote into the model into the engine's float32 partitions."""
        self.engine.optimizer.refresh_fp32_params()


@contextmanager
def engine_for(
    accelerator: Any, model: nn.Module, optimizer: torch.optim.Optimizer, settings: dict[str, Any]
) -> Iterator[ZeroEngine]:
    """``model`` and ``optimizer`` prepared by ``accelerator`` (launched with DeepSpeed) for one
    loop; the engine is destroyed on exit, its gradient hooks with it."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config.update(settings)
    config.pop("optimizer", None)  # the loop's own AdamW, with its scheduler and restarts
    config.pop("scheduler", None)
    engine, _ = accelerator.prepare(model, optimizer)
    try:
        yield ZeroEngine(engine)
    finally:
        accelerator.free_memory()
        own_storage(model)


def own_storage(model: nn.Module) -> None:
    """Give each parameter its own storage again: the engine makes the trained ones views into
    one flat buffer, which safetensors refuses to save (and which would keep it alive)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.data.untyped_storage().nbytes() != param.data.nbytes:
                param.data = param.data.clone()
