"""Entropy-Adaptive Fine-Tuning (EAFT): cross-entropy weighted by the model's top-k entropy."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from forgetless.contract.hooks import Batch, StepContext
from forgetless.contract.method import Capability, Knob, Method, MethodConfig, declare_method
from forgetless.core.fields import NonNegative
from forgetless.methods.papers import cite
from forgetless.methods.token_weighting import eaft_loss


class EAFTConfig(MethodConfig):
    name: Literal["eaft"] = "eaft"
    """Entropy-Adaptive Fine-Tuning: cross-entropy gated by entropy."""
    alpha: NonNegative = 1.0
    """α, the power of the normalised entropy weight (0: plain cross-entropy). Default 1 from
    LLaMA-Factory's eaft_alpha (the paper's linear gate)."""
    top_k: int = Field(20, ge=2)
    """k, the most likely next tokens the entropy is estimated from (and log k its normaliser).
    Default 20 from the paper and LLaMA-Factory."""


@declare_method(EAFTConfig, capabilities={Capability.REPLACE_LOSS}, paper=cite("diao2026"))
class EAFT(Method[EAFTConfig]):
    """EAFT (Diao et al. 2026, arXiv:2601.02151): the task loss becomes
    ``Σ_t (H_k(t) / log k)^α · (−log p_θ(y_t))`` over the completion tokens, a token mean, where
    ``H_k(t)`` is the entropy of the model's top-``k`` next-token distribution (renormalised),
    detached. A token the model is sure of (low entropy) but that the data contradicts, a
    "confident conflict", gets a small weight; a token it is unsure of keeps most of its loss.
    """

    unsharded = None  # reads only the step's own logits
    tail_logits_ok = True  # its loss aligns labels by the logits' tail
    knob = Knob("alpha", keeps_more="higher", low=0.01, high=10.0)
    """Under a budget: α (a higher power shrinks every weight below 1, confident tokens most)."""
    smoke: ClassVar[dict[str, Any]] = {"alpha": 1.0, "top_k": 20}

    def task_loss(self, batch: Batch, outputs: Any, ctx: StepContext) -> torch.Tensor:
        logits = outputs.logits
        labels = batch["labels"][:, -logits.size(1) :]
        return eaft_loss(logits, labels, self.config.alpha, self.config.top_k)
