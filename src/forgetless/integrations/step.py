"""One micro-batch's loss inside a trainer's ``compute_loss``: the trainer's own task loss plus
the method's named terms, computed by the same hooks the step loop calls
(``forgetless.engine.loop.StepLoop._loss``), so the terms equal a forgetless run's on the same
batch and weights.

The trainer keeps its own task loss (TRL's fused LM head, DFT, label smoothing, its metrics),
unless the method replaces it (``task_loss``: DFT, ASFT, EAFT); the replacement, a token mean of
the micro-batch, is then normalised as the trainer normalises its cross-entropy (by
``num_items_in_batch`` when the trainer counts it, else over the accumulation steps).
A penalty on the weights alone (EWC's ``(λ/2)·Σ F·(θ−θ*)²``, Kirkpatrick et al. 2017, PNAS)
needs no logits; where a method reads them (KL-SFT's KL to the base) and the trainer's forward
never built them (TRL's ``SFTTrainer`` computes log-probabilities in chunks), the terms get a
forward pass of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from forgetless.contract.method import Batch, Capability, Method, StepContext
from forgetless.errors import TrainingError
from forgetless.integrations.batches import (
    COLUMNS,
    labelled_tokens,
    recollate,
    rescaled_items,
    uncollate,
)

ComputeLoss = Callable[..., Any]
"""The trainer's own ``compute_loss`` (the next one in its class's order)."""


def reads_logits(method: Method[Any]) -> bool:
    """Whether the method's loss hooks read ``outputs.logits`` (``Method.window_ok``)."""
    terms = method.uses(Capability.LOSS_TERMS) and not method.window_ok
    return terms or method.uses(Capability.REPLACE_LOSS)


def loss_scaled_for_accumulation(trainer: Any, num_items: Any) -> bool:
    """Whether the trainer takes the returned loss as already divided over the accumulated
    batch (normalised by ``num_items_in_batch``) or divides it by the accumulation steps
    itself: the rule of ``transformers.Trainer.training_step``."""
    flag = getattr(trainer, "loss_is_scaled_for_ga", None)
    if flag is not None:
        return bool(flag)
    by_items = bool(getattr(trainer, "model_accepts_loss_kwargs", False)) and num_items is not None
    return by_items or getattr(trainer, "compute_loss_func", None) is not None


def replaced_loss_factor(trainer: Any, labels: torch.Tensor, num_items: Any, scale: float) -> Any:
    """What turns a method's replaced task loss, a token mean over the micro-batch, into the
    trainer's normalisation of its own cross-entropy: the micro-batch's scored tokens over
    ``num_items_in_batch`` (the accumulated batch's) when the trainer normalises by it, times
    the processes when it counts tokens across them, as ``Trainer.compute_loss`` does; else
    ``scale``, the accumulation's share."""
    if num_items is None or not loss_scaled_for_accumulation(trainer, num_items):
        return scale
    factor = labelled_tokens(labels) / num_items
    if getattr(trainer.args, "average_tokens_across_devices", False):
        factor = factor * trainer.accelerator.num_processes
    return factor


def accumulation_steps(trainer: Any) -> int:
    steps = getattr(trainer, "current_gradient_accumulation_steps", None)
    return int(steps or trainer.args.gradient_accumulation_steps)


def forward(model: nn.Module, batch: Batch) -> Any:
    """The model's logits over ``batch``, with their graph (as the step loop's forward)."""
    return model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    )


def _no_logits(loss: torch.Tensor) -> Any:
    """Outputs for a method that never reads the logits' values (``window_ok``): only their
    device and dtype, which a zero term is made from."""
    return SimpleNamespace(logits=loss.detach().new_zeros((1, 1, 1), dtype=torch.float32))


@dataclass
class StepLoss:
    """Computes one micro-batch's loss for ``method`` inside ``trainer``'s ``compute_loss``."""

    method: Method[Any]
    pad_id: int
    reuse_outputs: bool
    """The trainer's ``compute_loss`` is ``transformers.Trainer``'s: its outputs carry logits
    with their graph, which a method reading them may use without a second forward."""
    last: dict[str, float] = field(default_factory=dict)
    """The latest micro-batch's terms (``task`` the trainer's loss, or the method's replacement
    as a token mean), as plain numbers."""
    sums: dict[str, float] = field(default_factory=dict)
    micro: int = 0

    def __call__(
        self,
        trainer: Any,
        compute: ComputeLoss,
        model: nn.Module,
        inputs: dict[str, Any],
        sctx: StepContext,
        num_items: Any,
    ) -> tuple[torch.Tensor, Any]:
        method = self.method
        if method.uses(Capability.BATCH_TRANSFORM):
            inputs, num_items = self._transformed(inputs, sctx, num_items)
        scale = 1.0
        if loss_scaled_for_accumulation(trainer, num_items):
            scale = 1.0 / accumulation_steps(trainer)
        batch = {k: inputs[k] for k in COLUMNS if k in inputs}
        outputs: Any = None
        if method.uses(Capability.REPLACE_LOSS):
            outputs = forward(model, batch)
            recorded = method.task_loss(batch, outputs, sctx)
            task = recorded * replaced_loss_factor(trainer, batch["labels"], num_items, scale)
        else:
            if reads_logits(method) and self.reuse_outputs:
                task, outputs = compute(
                    model, inputs, return_outputs=True, num_items_in_batch=num_items
                )
            else:
                task = compute(model, inputs, return_outputs=False, num_items_in_batch=num_items)
            recorded = task / scale
        terms: dict[str, torch.Tensor] = {}
        if method.uses(Capability.LOSS_TERMS):
            if outputs is None:
                outputs = forward(model, batch) if reads_logits(method) else _no_logits(task)
            terms = method.loss_terms(batch, outputs, sctx)
            if "task" in terms:
                raise TrainingError(f"method {method.name!r} returned a reserved loss name 'task'")
        total = task
        for term in terms.values():
            total = total + term.reshape(()) * scale
        self._record(recorded, terms)
        return total, outputs

    def _transformed(
        self, inputs: dict[str, Any], sctx: StepContext, num_items: Any
    ) -> tuple[dict[str, Any], Any]:
        """The batch after the method's transform, and the trainer's token count for it."""
        features = self.method.transform_batch(uncollate(inputs), sctx)
        sctx.global_batch_size = len(features)
        batch = recollate(features, self.pad_id, inputs["input_ids"].device)
        before, after = labelled_tokens(inputs["labels"]), labelled_tokens(batch["labels"])
        return batch, rescaled_items(num_items, before, after)

    def _record(self, task: torch.Tensor, terms: dict[str, torch.Tensor]) -> None:
        names = ["task", *terms]
        parts = [task, *terms.values()]
        values = torch.stack([t.detach().reshape(()).double() for t in parts]).tolist()
        self.last = dict(zip(names, values, strict=True))
        for name, value in zip(names[1:], values[1:], strict=True):
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.micro += 1

    def take_means(self) -> dict[str, float]:
        """The mean of each method term since the last call (for the trainer's log)."""
        means = {k: v / self.micro for k, v in self.sums.items()} if self.micro else {}
        self.sums, self.micro = {}, 0
        return means
