"""Layer freezing: only a chosen set of decoder layers is trained; everything else stays put.

A heuristic baseline: forgetting is bounded by leaving most of the network untouched. Works with
full fine-tuning (the chosen layers' weights train) and with LoRA (only the adapters inside the
chosen layers train).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field

from forgetless.contract.hooks import TaskContext
from forgetless.contract.method import Capability, Method, MethodConfig, declare_method
from forgetless.core.fields import Count
from forgetless.errors import ConfigError

LAYER_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.")
"""Decoder layers as Llama, Qwen2 and Mistral name them: ``...model.layers.<i>.<...>``."""

# --- the math ---------------------------------------------------------------------------------


def layer_id(param_name: str) -> int | None:
    """The decoder layer a parameter belongs to, or None (embeddings, final norm, lm_head)."""
    match = LAYER_PATTERN.search(param_name)
    return int(match.group(1)) if match else None


def trainable_layer_ids(num_layers: int, top: int, layers: list[int] | None) -> set[int]:
    """The decoder layers to train: ``layers`` when given, else the ``top`` highest ones."""
    if num_layers < 1:
        raise ValueError("the model has no decoder layers")
    if layers is not None:
        missing = sorted({i for i in layers if not 0 <= i < num_layers})
        if missing:
            raise ValueError(
                f"layer(s) {missing} do not exist: the model has {num_layers} decoder layers "
                f"(0-{num_layers - 1})"
            )
        return set(layers)
    if not 1 <= top <= num_layers:
        raise ValueError(f"train_top_layers={top} must be within 1-{num_layers} (decoder layers)")
    return set(range(num_layers - top, num_layers))


# --- the method ---------------------------------------------------------------------------------


class FreezeConfig(MethodConfig):
    name: Literal["freeze"] = "freeze"
    """Layer freezing (train chosen layers)."""
    train_top_layers: Count = 1
    """Train only this many of the highest decoder layers (ignored when `layers` is set). No paper
    fixes a count; 1 is the most conservative setting that still learns."""
    layers: list[int] | None = Field(None, min_length=1)
    """Explicit 0-based decoder layer indices to train; overrides train_top_layers."""
    freeze_embeddings: bool = True
    """Also freeze what lies outside the decoder layers (embeddings, final norm, lm_head); when
    false those keep whatever trainability the fine-tuning mode gave them."""


@declare_method(FreezeConfig, capabilities={Capability.TASK_START})
class Freeze(Method[FreezeConfig]):
    """Layer freezing, the heuristic baseline that parameter-selective methods compare against.

    Named as a baseline (freezing specific layers) by attribution-guided continual fine-tuning
    (Italian summary in ``shared/papers/004_45aa58793794b78b.txt``), which argues that a fixed
    per-layer choice cannot tell which parameters old tasks need. The top layers are the default
    choice because lower layers carry the more general features (Yosinski et al., 2014, "How
    transferable are features in deep neural networks?"). Every trainable parameter outside the
    chosen layers gets ``requires_grad=False`` at each task start, so the optimizer never sees it.
    """

    smoke: ClassVar[dict[str, Any]] = {"train_top_layers": 1}
    unsharded = None  # requires_grad is per parameter: FSDP2 skips the frozen shards' gradients

    def __init__(self, config: FreezeConfig) -> None:
        super().__init__(config)

    def on_task_start(self, ctx: TaskContext) -> None:
        named = list(ctx.model.named_parameters())
        ids = [layer_id(n) for n, _ in named]
        present = [i for i in ids if i is not None]
        if not present:
            raise ConfigError(
                "method 'freeze': no decoder layers found (no parameter named 'layers.<i>.')"
            )
        try:
            chosen = trainable_layer_ids(
                max(present) + 1, self.config.train_top_layers, self.config.layers
            )
        except ValueError as err:
            raise ConfigError(f"method 'freeze': {err}") from None
        for (_, param), layer in zip(named, ids, strict=True):
            outside = layer not in chosen if layer is not None else self.config.freeze_embeddings
            if outside:
                param.requires_grad = False
        if not any(p.requires_grad for _, p in named):
            raise ConfigError(
                f"method 'freeze': nothing left to train in layers {sorted(chosen)} "
                "(are the LoRA target modules inside them?)"
            )
