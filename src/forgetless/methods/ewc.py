"""Elastic weight consolidation with a diagonal empirical Fisher, kept online across tasks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from forgetless.contract.hooks import Batch, MethodState, ReduceOp, StepContext, TaskEndContext
from forgetless.contract.method import Capability, Knob, Method, MethodConfig, declare_method
from forgetless.core import distributed, sharding
from forgetless.core.fields import Count, Fraction, NonNegative
from forgetless.core.modules import trainable_parameters
from forgetless.engine.loop import causal_lm_loss
from forgetless.methods.papers import cite
from forgetless.tasks.formatting import Features, collate

Tensors = Mapping[str, torch.Tensor]


def ewc_penalty(params: Tensors, fisher: Tensors, anchor: Tensors, lam: float) -> torch.Tensor:
    """``(λ/2) · Σ_i F_i (θ_i − θ*_i)²`` over the names in ``fisher`` (Kirkpatrick et al.)."""
    if not fisher:
        raise ValueError("ewc_penalty needs at least one Fisher tensor")
    terms = [(f * (params[n].float() - anchor[n].float()).pow(2)).sum() for n, f in fisher.items()]
    total = terms[0]
    for term in terms[1:]:  # added one by one: sums of sharded tensors cannot be stacked
        total = total + term
    return 0.5 * lam * total


def online_fisher(old: Tensors | None, new: Tensors, gamma: float) -> dict[str, torch.Tensor]:
    """``F ← γ·F_old + F_new`` (Schwarz et al. 2018); a name only in one of them keeps its part."""
    old = old or {}
    out = {n: gamma * f for n, f in old.items() if n not in new}
    out.update({n: f + gamma * old[n] if n in old else f.clone() for n, f in new.items()})
    return out


def empirical_fisher(
    model: nn.Module, features: list[Features], pad_id: int, batch_size: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Mean over batches of the squared gradient of the completion NLL, per trainable weight.

    With ``batch_size=1`` this is the per-example empirical Fisher; larger batches square the
    mini-batch mean gradient (cheaper, smaller where per-example gradients disagree).
    """
    params = trainable_parameters(model)
    fisher = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    model.eval()
    chunks = [features[i : i + batch_size] for i in range(0, len(features), batch_size)]
    with torch.enable_grad():
        for chunk in chunks:
            model.zero_grad(set_to_none=True)
            batch = {k: v.to(device) for k, v in collate(chunk, pad_id).items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            causal_lm_loss(logits.logits, batch["labels"]).backward()
            for n, p in params.items():
                if p.grad is not None:
                    fisher[n] += p.grad.detach().float().pow(2)
    model.zero_grad(set_to_none=True)
    return {n: f / max(1, len(chunks)) for n, f in fisher.items()}


class EWCConfig(MethodConfig):
    name: Literal["ewc"] = "ewc"
    """Elastic weight consolidation (online)."""
    lam: NonNegative = 1e5
    """λ, the penalty strength. Kirkpatrick et al. tune it per benchmark; an LLM's per-weight Fisher
    is ~‖g‖²/P (~1e-9 at 1B weights) and a task moves a weight ~1e-3, so Σ F·Δθ² is ~1e-6 and
    λ≈1e5 puts the penalty at a few percent of the token loss."""
    gamma: Fraction = 1.0
    """Decay of the old Fisher in F ← γ·F_old + F_new (Schwarz et al. 2018); 1.0 = plain
    accumulation over tasks."""
    fisher_samples: Count = 200
    """Training examples of the finished task used for the Fisher."""
    fisher_batch_size: Count = 1
    """Examples per Fisher gradient; 1 gives the exact per-example empirical Fisher of Kirkpatrick
    et al., more is faster and squares mini-batch means instead."""


@declare_method(
    EWCConfig,
    capabilities={Capability.LOSS_TERMS, Capability.TASK_END, Capability.STATE},
    paper=cite("kirkpatrick2017"),
)
class EWC(Method[EWCConfig]):
    """Elastic weight consolidation (Kirkpatrick et al. 2017, "Overcoming catastrophic forgetting
    in neural networks", PNAS), in the online form of Schwarz et al. 2018 ("Progress & Compress"):
    one diagonal Fisher ``F ← γ·F_old + F_new`` and one anchor θ* (the weights after the latest
    task). Each step adds ``(λ/2)·Σ F·(θ−θ*)²`` over the trainable weights by name, so full
    fine-tuning and a LoRA ``carry`` adapter both work. Memory: two float copies of the trainable
    weights (Fisher and anchor) on the device.
    """

    carry_only = "anchors weights by name"
    unsharded = None  # Fisher and anchor are element-wise: each process keeps its shards
    knob = Knob("lam", keeps_more="higher", low=1.0, high=1e9)
    """Under a budget: λ, the penalty weight."""
    smoke: ClassVar[dict[str, Any]] = {"lam": 1e4, "fisher_samples": 8, "fisher_batch_size": 4}
    window_ok = True  # its penalty reads the weights, never the logits
    reduce_ops: ClassVar[Mapping[str, ReduceOp]] = {"fisher": "mean"}

    def __init__(self, config: EWCConfig) -> None:
        super().__init__(config)
        self.fisher: dict[str, torch.Tensor] = {}
        self.anchor: dict[str, torch.Tensor] = {}

    def loss_terms(self, batch: Batch, outputs: Any, ctx: StepContext) -> dict[str, torch.Tensor]:
        if not self.fisher:
            return {"ewc": outputs.logits.new_zeros((), dtype=torch.float32)}
        params = trainable_parameters(ctx.task.model)
        self._to(next(iter(params.values())).device)
        live = {n: f for n, f in self.fisher.items() if n in params}
        if not live:
            return {"ewc": outputs.logits.new_zeros((), dtype=torch.float32)}
        penalty = sharding.replicated(ewc_penalty(params, live, self.anchor, self.config.lam))
        return {"ewc": distributed.parameter_term(penalty, ctx.batch_share)}

    def on_task_end(self, ctx: TaskEndContext) -> None:
        task = ctx.task
        gen = torch.Generator().manual_seed(task.run.seed * 1000 + task.task_index)
        order = torch.randperm(len(task.train_features), generator=gen)[
            : self.config.fisher_samples
        ]
        sample = [task.train_features[i] for i in order.tolist()]
        pad_id = task.tokenizer.pad_token_id
        new = empirical_fisher(
            task.model, sample, pad_id, self.config.fisher_batch_size, task.device
        )
        self.fisher = online_fisher(self.fisher, new, self.config.gamma)
        self.anchor = {n: p.detach().clone() for n, p in trainable_parameters(task.model).items()}

    def state_dict(self) -> MethodState:
        return {"fisher": dict(self.fisher), "anchor": dict(self.anchor)}

    def load_state_dict(self, state: MethodState) -> None:
        self.fisher = dict(state.get("fisher", {}))
        self.anchor = dict(state.get("anchor", {}))

    def _to(self, device: torch.device) -> None:
        """Move restored (CPU) state next to the weights once."""
        for store in (self.fisher, self.anchor):
            for n, t in store.items():
                if t.device != device:
                    store[n] = t.to(device)
