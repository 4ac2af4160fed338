"""SFT plus a static KL penalty toward the base model's next-token distribution (KL-SFT)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch

from forgetless.contract.hooks import Batch, StepContext
from forgetless.contract.method import Capability, Knob, MethodConfig, declare_method
from forgetless.core.fields import NonNegative
from forgetless.eval import metrics
from forgetless.methods.base_reference import AnchoredToBase
from forgetless.methods.papers import cite
from forgetless.tasks.formatting import IGNORE_INDEX

Direction = Literal["model_to_base", "base_to_model"]


def token_kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    mask: torch.Tensor,
    direction: Direction = "model_to_base",
) -> torch.Tensor:
    """Mean over ``mask`` positions of ``KL(p_model ‖ p_ref)`` (or ``KL(p_ref ‖ p_model)``).

    ``logits``/``ref_logits``: ``(..., V)``; ``mask``: ``(...)``. No selected position gives 0
    (still attached to ``logits`` so the loss stays differentiable).
    """
    if not bool(mask.any()):
        return logits.sum() * 0.0
    logp, logq = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref_logits.float(), -1)
    if direction == "model_to_base":
        return metrics.token_kl(logp, logq, mask)
    return metrics.token_kl(logq, logp, mask)


class KLSFTConfig(MethodConfig):
    name: Literal["kl_sft"] = "kl_sft"
    """SFT + static KL to the base model."""
    beta: NonNegative = 0.1
    """β, the weight of the KL term. The Anchored Learning summary names KL-SFT as a baseline
    without a value; 0.1 is a moderate default, tune it per run."""
    direction: Direction = "model_to_base"
    """model_to_base: KL(p_θ ‖ p_base), the reverse (mode-seeking) KL of KL-regularised fine-tuning;
    base_to_model: KL(p_base ‖ p_θ), a fixed-teacher distillation."""


@declare_method(
    KLSFTConfig,
    capabilities={Capability.TASK_START, Capability.LOSS_TERMS},
    paper=cite("anchored_learning"),
)
class KLSFT(AnchoredToBase[KLSFTConfig]):
    """KL-SFT, a baseline of Anchored Learning ("Stabilizing LLM Supervised Fine-Tuning via
    Explicit Distributional Control"; summary in shared/papers/002): the task's cross-entropy
    plus ``β · mean_t KL(p_θ(·|x_<t) ‖ p_base(·|x_<t))`` over completion tokens, a *static*
    regulariser toward the base (pre-sequence) model that the paper contrasts with its moving
    anchor. The summary fixes neither the direction nor β; the default direction is the reverse
    KL of KL-regularised fine-tuning, and ``direction`` switches it.

    The reference is the run's base model (``BaseReference``): under LoRA the model itself with
    its adapters switched off, no second copy of the weights; else a frozen copy loaded from the
    run's base-model source, so a resumed run gets the same reference. It costs one extra no-grad
    forward per micro-batch, over the same completion window as the loop's logits.
    """

    knob = Knob("beta", keeps_more="higher", low=1e-4, high=1e3)
    """Under a budget: β, the KL weight."""
    smoke: ClassVar[dict[str, Any]] = {"beta": 0.1}

    def loss_terms(self, batch: Batch, outputs: Any, ctx: StepContext) -> dict[str, torch.Tensor]:
        logits = outputs.logits
        ref_logits = self.reference.logits(batch, ctx, logits.size(1))
        mask = batch["labels"][:, -logits.size(1) :][:, 1:] != IGNORE_INDEX
        kl = token_kl(logits[:, :-1], ref_logits[:, :-1], mask, self.config.direction)
        return {"kl_sft": self.config.beta * kl}
