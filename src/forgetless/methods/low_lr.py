"""Low-SFT: sequential fine-tuning at a reduced learning rate."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from forgetless.contract.hooks import Stage
from forgetless.contract.method import Capability, Knob, Method, MethodConfig, declare_method
from forgetless.contract.plan import TrainStats
from forgetless.core.fields import Positive
from forgetless.methods.papers import cite


def scaled_lr(lr: float, lr_scale: float) -> float:
    """The learning rate Low-SFT trains at."""
    return lr * lr_scale


class LowLRConfig(MethodConfig):
    name: Literal["low_lr"] = "low_lr"
    """Low-SFT: SFT at a reduced LR."""
    lr_scale: Positive = 0.1
    """Factor on each task's learning rate. The Anchored Learning summary gives no value for
    Low-SFT; 0.1 (one decade lower) is this toolkit's default."""


@declare_method(LowLRConfig, capabilities={Capability.TRAIN_STAGE}, paper=cite("anchored_learning"))
class LowLR(Method[LowLRConfig]):
    """Low-SFT, a baseline of Anchored Learning ("Stabilizing LLM Supervised Fine-Tuning via
    Explicit Distributional Control"; summary in shared/papers/002): plain SFT whose learning
    rate is scaled down, trading target-task gain for stability (the paper finds it keeps
    general capability but gives up domain accuracy). Everything else is the shared
    loop with the task's resolved plan (steps, schedule, clipping).
    """

    knob = Knob(
        "lr_factor", keeps_more="lower", low=0.01, high=10.0, learning_rate=True
    )  # budget: a factor on its reduced learning rate
    unsharded = None  # the shared loop only: runs on FSDP2 shards
    smoke: ClassVar[dict[str, Any]] = {"lr_scale": 0.1}

    def __init__(self, config: LowLRConfig) -> None:
        super().__init__(config)

    def train_task(self, stage: Stage) -> TrainStats:
        return stage.sft(lr=scaled_lr(stage.plan.lr, self.config.lr_scale))
