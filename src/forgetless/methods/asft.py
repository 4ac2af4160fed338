"""Anchored SFT (ASFT): DFT's token-weighted loss plus a KL anchor to the frozen base model."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch

from forgetless.contract.hooks import Batch, StepContext
from forgetless.contract.method import Capability, Knob, MethodConfig, declare_method
from forgetless.core.fields import NonNegative
from forgetless.methods.base_reference import AnchoredToBase
from forgetless.methods.papers import cite
from forgetless.methods.token_weighting import KLDirection, asft_loss, dft_loss


class ASFTConfig(MethodConfig):
    name: Literal["asft"] = "asft"
    """Anchored SFT: DFT plus a KL to the base."""
    alpha: NonNegative = 0.1
    """α, the weight of the KL anchor (0: DFT). Default 0.1 from LLaMA-Factory's asft_alpha;
    NeMo-RL's kl_weight defaults to 0.03."""
    direction: KLDirection = "forward"
    """forward: KL(p_base ‖ p_θ) over the full vocabulary (LLaMA-Factory's); reverse: Schulman's k3
    estimate of KL(p_θ ‖ p_base) from the target token's log-probabilities alone (NeMo-RL's)."""


@declare_method(
    ASFTConfig, capabilities={Capability.TASK_START, Capability.REPLACE_LOSS}, paper=cite("zhu2025")
)
class ASFT(AnchoredToBase[ASFTConfig]):
    """ASFT (Zhu et al. 2025, arXiv:2509.23753): the task loss becomes, per completion token,
    DFT's ``sg(p_θ(y_t)) · (−log p_θ(y_t))`` plus ``α · KL_t`` to the base model, a token mean.
    DFT tightens SFT's bound on the RL objective but lets the model drift; the KL anchors it.

    The reference is the run's base model (``BaseReference``: under LoRA the model with its
    adapters off, so the KL is 0 while the adapters are zero; else a frozen loaded copy), over
    the same completion window as the loop's logits.
    """

    knob = Knob("alpha", keeps_more="higher", low=1e-4, high=1e3)
    """Under a budget: α, the KL weight."""
    smoke: ClassVar[dict[str, Any]] = {"alpha": 0.1}

    def task_loss(self, batch: Batch, outputs: Any, ctx: StepContext) -> torch.Tensor:
        logits = outputs.logits
        labels = batch["labels"][:, -logits.size(1) :]
        if self.config.alpha == 0.0:
            return dft_loss(logits, labels)  # no anchor: its forward would be wasted
        ref_logits = self.reference.logits(batch, ctx, logits.size(1))
        return asft_loss(logits, ref_logits, labels, self.config.alpha, self.config.direction)
