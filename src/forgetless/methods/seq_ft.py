"""Sequential fine-tuning: plain SFT on each task in turn, the lower bound every method must beat.

With ``finetune.mode: lora`` and the default ``carry`` regime this is SeqLoRA (one adapter trained
across the whole sequence).
"""

from __future__ import annotations

from typing import Literal

from forgetless.contract.method import Knob, Method, MethodConfig, declare_method


class SeqFTConfig(MethodConfig):
    name: Literal["seq_ft"] = "seq_ft"
    """Sequential fine-tuning (no control)."""


@declare_method(SeqFTConfig)
class SeqFT(Method[SeqFTConfig]):
    """Uses no hook: the shared loop's cross-entropy on the current task is all it does."""

    knob = Knob(
        "lr_scale", keeps_more="lower", low=0.01, high=1.0, learning_rate=True
    )  # budget: its learning rate (low_lr's knob), up to the configured one
    unsharded = None  # the shared loop only: runs on FSDP2 shards
