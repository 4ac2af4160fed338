"""Anchored SFT (ASFT): DFT's token-weighted loss plus a KL anchor to the frozen base model."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from forgetless.contract.hooks import Batch, RunInfo, StepContext, TaskContext
from forgetless.contract.method import Capability, Knob, Method, MethodConfig, Paper, declare_method
from forgetless.core.modules import evaluating, freeze
from forgetless.methods.token_weighting import KLDirection, asft_loss, dft_loss


class ASFTConfig(MethodConfig):
    name: Literal["asft"] = Field("asft", description="Anchored SFT: DFT plus a KL to the base.")
    alpha: float = Field(
        0.1,
        ge=0,
        description="α, the weight of the KL anchor (0: DFT). Default 0.1 from LLaMA-Factory's "
        "asft_alpha; NeMo-RL's kl_weight defaults to 0.03.",
    )
    direction: KLDirection = Field(
        "forward",
        description="forward: KL(p_base ‖ p_θ) over the full vocabulary (LLaMA-Factory's); "
        "reverse: Schulman's k3 estimate of KL(p_θ ‖ p_base) from the target token's "
        "log-probabilities alone (NeMo-RL's).",
    )


def adapters_over_base(run: RunInfo, model: nn.Module) -> bool:
    """Whether the model is the base under LoRA adapters, so that switching the adapters off
    gives the base itself (not so in the ``merge`` regime, which folds each task in)."""
    peft = callable(getattr(model, "disable_adapter", None))
    return peft and run.finetune_mode == "lora" and run.lora_regime != "merge"


@declare_method(
    "asft",
    ASFTConfig,
    capabilities={Capability.TASK_START, Capability.REPLACE_LOSS},
    paper=Paper("Anchored Supervised Fine-Tuning", "Zhu et al.", 2025, "arXiv:2509.23753"),
)
class ASFT(Method[ASFTConfig]):
    """ASFT (Zhu et al. 2025, arXiv:2509.23753): the task loss becomes, per completion token,
    DFT's ``sg(p_θ(y_t)) · (−log p_θ(y_t))`` plus ``α · KL_t`` to the base model, a token mean.
    DFT tightens SFT's bound on the RL objective but lets the model drift; the KL anchors it.

    The reference is the run's base model. Under LoRA (carry or per-task adapters) it is the
    model itself with its adapters switched off for one no-grad forward: no second copy of the
    weights, and exactly the base, so the KL is 0 while the adapters are zero. Otherwise (full
    fine-tuning, or the ``merge`` regime, whose weights move) it is a frozen copy loaded from the
    run's base-model source, as KL-SFT's. Either way a resumed run gets the same reference.
    """

    unsharded = None  # a loaded reference stays whole on each process, as KL-SFT's
    knob = Knob("alpha", keeps_more="higher", low=1e-4, high=1e3)
    """Under a budget: α, the KL weight."""
    smoke: ClassVar[dict[str, Any]] = {"alpha": 0.1}

    def __init__(self, config: ASFTConfig) -> None:
        super().__init__(config)
        self.reference: nn.Module | None = None
        self.adapter_free = False

    def on_task_start(self, ctx: TaskContext) -> None:
        self.adapter_free = adapters_over_base(ctx.run, ctx.model)
        if self.adapter_free or self.reference is not None:
            return
        self.reference = freeze(ctx.run.base_loader(self.name)()).to(ctx.device)

    def task_loss(self, batch: Batch, outputs: Any, ctx: StepContext) -> torch.Tensor:
        logits = outputs.logits
        labels = batch["labels"][:, -logits.size(1) :]
        if self.config.alpha == 0.0:
            return dft_loss(logits, labels)  # no anchor: its forward would be wasted
        ref_logits = self.reference_logits(batch, ctx)[:, -logits.size(1) :]
        return asft_loss(logits, ref_logits, labels, self.config.alpha, self.config.direction)

    @torch.no_grad()
    def reference_logits(self, batch: Batch, ctx: StepContext) -> torch.Tensor:
        """The base model's logits on the batch, under the step's autocast."""
        device = batch["input_ids"].device
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        with torch.autocast(device.type, torch.bfloat16, enabled=ctx.autocast):
            if not self.adapter_free:
                assert self.reference is not None, "on_task_start loads the reference"
                return self.reference(**inputs, use_cache=False).logits
            model = ctx.task.model
            with evaluating(model), model.disable_adapter():  # type: ignore[operator]
                return model(**inputs, use_cache=False).logits
