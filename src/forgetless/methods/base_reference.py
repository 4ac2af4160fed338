"""The base model's logits beside a training step, for the methods that anchor to it (KL-SFT,
ASFT): under LoRA the model itself with its adapters switched off, else a frozen loaded copy."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from forgetless.contract.hooks import Batch, RunInfo, StepContext, TaskContext
from forgetless.contract.method import ConfigT, Method
from forgetless.core.modules import evaluating, freeze
from forgetless.methods.shared_prefix import SharedPrefix, agrees, shared_prefix


def adapters_over_base(run: RunInfo, model: nn.Module) -> bool:
    """Whether the model is the base under LoRA adapters, so that switching the adapters off
    gives the base itself (not so in the ``merge`` regime, which folds each task in)."""
    peft = callable(getattr(model, "disable_adapter", None))
    return peft and run.finetune_mode == "lora" and run.lora_regime != "merge"


class BaseReference:
    """Where a method's reference logits come from.

    Under LoRA (carry or per-task adapters) the reference is the trained model with its
    adapters switched off for one no-grad forward: no second copy of the weights, and exactly
    the base. That forward resumes from the training forward's hidden state below the lowest
    adapted layer (``shared_prefix``), checked once per task against a full one. Otherwise
    (full fine-tuning, or the ``merge`` regime, whose weights move) it is a frozen copy loaded
    once from the run's base-model source, so a resumed run gets the same reference as an
    uninterrupted one.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.copy: nn.Module | None = None
        self.adapter_free = False
        self.prefix: SharedPrefix | None = None
        self.prefix_checked = False

    def start(self, ctx: TaskContext) -> None:
        """Choose the source for this task; load the copy the first time one is needed."""
        self.adapter_free = adapters_over_base(ctx.run, ctx.model)
        if self.prefix is not None:
            self.prefix.detach()
        self.prefix = shared_prefix(ctx.model) if self.adapter_free else None
        self.prefix_checked = False
        if not self.adapter_free and self.copy is None:
            self.copy = freeze(ctx.run.base_loader(self.owner)()).to(ctx.device)

    @torch.no_grad()
    def logits(self, batch: Batch, ctx: StepContext, keep: int) -> torch.Tensor:
        """The base's logits over the batch's last ``keep`` positions, under the step's bf16
        autocast when it has one."""
        device = batch["input_ids"].device
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        window = {"logits_to_keep": keep, "use_cache": False}
        with torch.autocast(device.type, torch.bfloat16, enabled=ctx.autocast):
            if not self.adapter_free:
                assert self.copy is not None, "start() loads the reference"
                return self.copy(**inputs, **window).logits
            model = ctx.task.model
            with evaluating(model), model.disable_adapter():  # type: ignore[operator]
                if self.prefix is None or not self.prefix.ready_for(batch["input_ids"]):
                    return model(**inputs, **window).logits
                shared = self.prefix.logits(keep)
                if self.prefix_checked:
                    return shared
                full = model(**inputs, **window).logits
                self.prefix_checked = True
                if not agrees(shared, full):
                    self.prefix.detach()
                    self.prefix = None
                return full


class AnchoredToBase(Method[ConfigT]):
    """The shared part of the methods whose loss compares the model with the run's base model
    (KL-SFT, ASFT): one ``BaseReference``, whose source is chosen again at each task's start."""

    unsharded: ClassVar[str | None] = None  # the frozen reference stays whole on each process
    tail_logits_ok = True  # their losses align labels by the logits' tail

    def __init__(self, config: ConfigT) -> None:
        super().__init__(config)
        self.reference = BaseReference(self.name)

    def on_task_start(self, ctx: TaskContext) -> None:
        self.reference.start(ctx)
