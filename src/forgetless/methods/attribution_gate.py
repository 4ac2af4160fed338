"""Attribution-guided fine-tuning: LRP importance of past tasks gates each parameter's update."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from forgetless.attribution.importance import (
    MapAccumulator,
    Scaling,
    Sign,
    gate_update_,
    historical_max,
    keep_factor,
    permuted_maps,
)
from forgetless.attribution.relevance import relevance_session
from forgetless.contract.hooks import (
    MethodState,
    ReduceOp,
    StepContext,
    TaskContext,
    TaskEndContext,
)
from forgetless.contract.method import Capability, Knob, Method, MethodConfig, declare_method
from forgetless.core import sharding
from forgetless.core.dtypes import DTYPES
from forgetless.core.fields import Count, Fraction
from forgetless.core.modules import trainable_parameters
from forgetless.methods.papers import cite
from forgetless.tasks.formatting import collate


class AttributionGateConfig(MethodConfig):
    name: Literal["attribution_gate"] = "attribution_gate"
    """LRP-importance gating of updates (Liu et al. 2026)."""
    gate: Literal["update", "gradient"] = "update"
    """What 1 − R̄ scales. 'update' (default): the optimizer's step, weight decay included.
    'gradient': the gradient, as in the paper; under Adam a constant per-coordinate gradient
    scale largely cancels between the two moments."""
    top_fraction: float = Field(0.01, gt=0, le=1)
    """Per tensor and sample, relevance is divided by the mean of its top fraction of entries (top-K
    mean) and clipped at 1."""
    log_scale: bool = True
    """Compress relevance as log1p(|R| / mean |R|) before normalizing."""
    sign: Sign = "abs"
    """'abs': |R|. 'positive': [R]+, the paper's choice (evidence for the prediction only)."""
    scaling: Scaling = "topk_mean"
    """Per-sample normalisation: 'topk_mean' (divide by the top-fraction mean, clip at 1) or
    'quantile' (each weight's rank in its tensor, in [0, 1])."""
    strength: Fraction = 1.0
    """s in the gate 1 − s·R̄ (1: the paper's gate)."""
    control: Literal["none", "permuted"] = "none"
    """'permuted': gate with R̄'s entries shuffled within each tensor (seeded), the control that
    keeps the gate's strength and loses where it acts."""
    max_samples: Count = 64
    """Training examples scored at task end; the correct ones count."""
    map_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    """Storage precision of the aggregated map R̄ (one value per weight)."""


@declare_method(
    AttributionGateConfig,
    capabilities={
        Capability.UPDATE_GATE,
        Capability.ACTIVATION_HOOKS,
        Capability.TASK_END,
        Capability.STATE,
    },
    paper=cite("liu2026"),
)
class AttributionGate(Method[AttributionGateConfig]):
    """Attribution-guided continual fine-tuning (Liu et al. 2026, "Attribution-Guided Continual
    Learning for Large Language Models", arXiv:2605.05285). After each task, parameter relevance
    (``θ ⊙ ∂θ`` under AttnLRP's rules, ``forgetless.attribution``) of the predicted logits of the
    training samples the model answers correctly, normalized per sample and averaged, gives the
    task map ``R_t ∈ [0, 1]``; ``R̄ = [max_τ R_τ]₊`` is kept as one map. While training later
    tasks each trainable weight's update is scaled by ``1 − R̄`` (``gate='update'``, default) or
    its gradient is (``gate='gradient'``, the paper's form). The optimizer (AdamW) is created
    afresh for each task, so its state is reset at task boundaries.
    """

    carry_only = "keeps its map by parameter name"
    unquantized = "propagates relevance through the base's weights, which 4-bit layers hide"
    knob = Knob("strength", keeps_more="higher", low=1e-3, high=1.0)
    """Under a budget: s in the gate 1 − s·R̄, rewritten in place when it moves."""
    smoke: ClassVar[dict[str, Any]] = {"max_samples": 4}
    reduce_ops: ClassVar[Mapping[str, ReduceOp]] = {"importance": "max"}
    unsharded = None  # maps made whole from the relevance shards; each gate split like its weight

    @classmethod
    def unsharded_with(cls, config: MethodConfig) -> str | None:
        if getattr(config, "gate", None) == "gradient":
            return (
                "scales gradients by a hook that FSDP2's reduce-scattered gradient shards never "
                "pass through; use gate 'update'"
            )
        return None

    def __init__(self, config: AttributionGateConfig) -> None:
        super().__init__(config)
        self.importance: dict[str, torch.Tensor] = {}
        self.tasks_seen = 0
        self._gated: list[tuple[str, nn.Parameter, torch.Tensor]] = []
        self._maps: Mapping[str, torch.Tensor] = {}
        """The maps the gates of this task come from (permuted under the control)."""

    def register_hooks(self, ctx: TaskContext) -> list[torch.utils.hooks.RemovableHandle]:
        self._gated = self._gate_factors(ctx.model, ctx.run.seed)
        if self.config.gate != "gradient":
            return []
        return [param.register_hook(_scaler(keep)) for _, param, keep in self._gated]

    def set_knob(self, value: float) -> None:
        """A new strength s acts at once: the gates ``1 − s·R̄`` are rewritten in place, so the
        gradient hooks and the update gate of the running task use it from the next step."""
        super().set_knob(value)
        for name, param, keep in self._gated:
            keep.copy_(sharding.split_like(keep_factor(self._maps[name], keep.dtype, value), param))

    def gate_update(
        self, model: nn.Module, pre_step: dict[str, torch.Tensor], ctx: StepContext
    ) -> None:
        if self.config.gate != "update":
            return
        for name, param, keep in self._gated:
            gate_update_(param, pre_step[name], keep)

    def on_task_end(self, ctx: TaskEndContext) -> None:
        task = ctx.task
        names = set(trainable_parameters(task.model))
        cfg = self.config
        accumulator = MapAccumulator(cfg.top_fraction, cfg.log_scale, cfg.sign, cfg.scaling)
        gen = torch.Generator().manual_seed(task.run.seed * 1000 + task.task_index)
        order = torch.randperm(len(task.train_features), generator=gen)[: self.config.max_samples]
        start = time.perf_counter()
        with relevance_session(task.model, names) as score:
            for i in order.tolist():
                batch = collate([task.train_features[i]], task.tokenizer.pad_token_id)
                result = score({k: v.to(task.device) for k, v in batch.items()}, correct_only=True)
                if result.correct:  # sharded: every process scored the sample; made whole
                    accumulator.add(
                        {n: sharding.replicated(r) for n, r in result.relevance.items()}
                    )
        seconds = time.perf_counter() - start
        dtype = DTYPES[self.config.map_dtype]
        new = {n: m.to(dtype).cpu() for n, m in accumulator.mean().items()}
        self.importance = historical_max(self.importance, new)
        self.tasks_seen += 1
        ctx.stats.details["attribution"] = _summary(
            new, self.importance, accumulator.count, len(order), seconds
        )

    def state_dict(self) -> MethodState:
        return {"importance": dict(self.importance), "tasks_seen": self.tasks_seen}

    def load_state_dict(self, state: MethodState) -> None:
        # a resume splits tensors named like parameters; the maps are kept whole (a collective)
        maps = state.get("importance", {})
        self.importance = {n: sharding.replicated(m).cpu() for n, m in maps.items()}
        self.tasks_seen = int(state.get("tasks_seen", 0))

    def _gate_factors(
        self, model: nn.Module, seed: int
    ) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """``(name, weight, 1 − s·R̄)`` per trainable weight with a map, on its device and
        dtype; under the permuted control, R̄ shuffled within each tensor first."""
        maps = self.importance
        if self.config.control == "permuted" and maps:
            maps = permuted_maps(maps, seed * 1000 + self.tasks_seen)
        self._maps = maps
        strength = self.config.strength
        return [
            (
                name,
                param,
                sharding.split_like(
                    keep_factor(maps[name], param.dtype, strength).to(param.device), param
                ),
            )
            for name, param in model.named_parameters()
            if param.requires_grad and name in maps
        ]


def _scaler(keep: torch.Tensor) -> Any:
    return lambda grad: grad * keep


def _summary(
    new: Mapping[str, torch.Tensor],
    aggregated: Mapping[str, torch.Tensor],
    n_correct: int,
    n_scored: int,
    seconds: float,
) -> dict[str, Any]:
    def stats(maps: Mapping[str, torch.Tensor]) -> dict[str, float]:
        if not maps:
            return {"mean": 0.0, "frac_above_half": 0.0}
        flat = torch.cat([m.float().flatten() for m in maps.values()])
        return {"mean": float(flat.mean()), "frac_above_half": float((flat > 0.5).float().mean())}

    return {
        "samples_scored": n_scored,
        "samples_correct": n_correct,
        "seconds_per_sample": seconds / max(1, n_scored),
        "task_map": stats(new),
        "aggregated_map": stats(aggregated),
    }
