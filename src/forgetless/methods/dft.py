"""Dynamic Fine-Tuning (DFT): each target token's cross-entropy weighted by its own probability."""

from __future__ import annotations

from typing import Any, Literal

import torch

from forgetless.contract.hooks import Batch, StepContext
from forgetless.contract.method import Capability, Knob, Method, MethodConfig, declare_method
from forgetless.methods.papers import cite
from forgetless.methods.token_weighting import dft_loss


class DFTConfig(MethodConfig):
    name: Literal["dft"] = "dft"
    """Dynamic Fine-Tuning: cross-entropy weighted by the token's probability."""


@declare_method(DFTConfig, capabilities={Capability.REPLACE_LOSS}, paper=cite("wu2025"))
class DFT(Method[DFTConfig]):
    """DFT (Wu et al. 2025, arXiv:2508.05629): the task loss becomes
    ``−Σ_t sg(p_θ(y_t)) · log p_θ(y_t)`` over the completion tokens (``sg``: no gradient through
    the weight), a token mean like the loop's cross-entropy. Read as policy gradient, SFT's
    gradient carries an implicit ``1/p`` weight; DFT's weight cancels it, so tokens the model
    finds unlikely no longer dominate the update. No setting, no reference model.
    """

    unsharded = None  # reads only the step's own logits
    tail_logits_ok = True  # its loss aligns labels by the logits' tail
    knob = Knob("lr_scale", keeps_more="lower", low=0.01, high=1.0, learning_rate=True)
    """Under a budget: the learning rate (DFT has no strength of its own)."""

    def task_loss(self, batch: Batch, outputs: Any, ctx: StepContext) -> torch.Tensor:
        logits = outputs.logits
        return dft_loss(logits, batch["labels"][:, -logits.size(1) :])
