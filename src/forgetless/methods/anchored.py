"""Anchored Learning: SFT toward a moving anchor between the student and a frozen SFT reference."""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn
from transformers import AutoModelForCausalLM

from forgetless.contract.hooks import Batch, LossFn, Stage, StepContext, TaskContext
from forgetless.contract.method import Capability, Method, MethodConfig, declare_method
from forgetless.contract.plan import TrainStats
from forgetless.core import sharding
from forgetless.core.fields import Count, Fraction, Positive
from forgetless.core.modules import freeze
from forgetless.engine.loop import steps_for_epochs
from forgetless.engine.resources import peak_memory_mb
from forgetless.errors import ConfigError, ModelLoadError, TrainingError
from forgetless.eval.generation import teacher_forced_logits
from forgetless.methods.anchored_math import (
    Space,
    anchor_logprobs,
    cache_bytes_per_token,
    cached_anchor_kl,
    index_dtype,
    kl_bound,
    kl_per_position,
    topk_anchor,
)
from forgetless.methods.papers import cite
from forgetless.tasks.formatting import IGNORE_INDEX, Features, collate

_DEFAULTS = "the public re-implementation cited in the toolkit's Anchored Learning issue"


class AnchoredConfig(MethodConfig):
    name: Literal["anchored"] = "anchored"
    """Anchored Learning."""
    alpha: Fraction = Field(
        0.5,
        description=f"α, the anchor's weight on the SFT reference (0: the student itself, "
        f"nothing to fit; 1: the reference). Default 0.5 from {_DEFAULTS}; the paper finds an "
        "intermediate α best.",
    )
    space: Space = Field(
        "logit",
        description="logit: geometric mean of the two distributions (mode-seeking, the paper's "
        "stability side); prob: arithmetic mixture (mode-covering, plasticity side). Default "
        f"logit from {_DEFAULTS}.",
    )
    outer_iterations: Count = Field(
        5, description=f"T, anchors per task (one cache each). Default 5 from {_DEFAULTS}."
    )
    inner_epochs: Positive = Field(
        5.0,
        description=f"K, epochs over the task data fitting each anchor. Default 5 from "
        f"{_DEFAULTS}; ignored when inner_steps is set.",
    )
    inner_steps: Count | None = None
    """Optimizer steps per anchor, overriding inner_epochs: for a budget matched to a baseline (e.g.
    T·inner_steps = its steps on the tiny demo). Toolkit option."""
    top_k: Count = 32
    """Anchor entries cached per token (plus one tail bucket); exact when at least the vocabulary
    size. Toolkit default (the paper forms the anchor on the fly)."""
    reference_from: Literal["current", "base"] = "current"
    """What the per-task SFT reference is trained from (the task's own plan): a copy of the current
    model (in a single task, the paper's SFT of the model being tuned) or the run's base model.
    Toolkit option."""
    reference_path: str | None = None
    """Load the reference from this save_pretrained folder instead of training it; {task} and
    {index} are replaced by the task's name and 1-based index."""
    student_init: Literal["current", "base"] = "current"
    """Where the student starts each task: the current model (continual), or the run's base weights
    (full fine-tuning only). In the paper's single-task runs both are the base model."""
    cache_batch_size: Count | None = None
    """Batch size of the no-grad passes that build each cache (default: the task's batch size).
    Toolkit option."""
    measure: bool = True
    """Live step KL(p_θ(t+1)‖p_θ(t)) and residual KL(q_t‖p_θ(t+1)): keeps a frozen snapshot of θ(t)
    and adds one forward of it per anchor. The bound is always recorded."""
    anchor_pool: Literal["task", "drawn"] = "task"
    """What each anchor is formed over: task, the whole task data (the paper); drawn, only the
    examples that anchor's inner steps draw (a fresh draw per anchor), for budgets where T ×
    inner_steps × batch covers a fraction of the task data. Toolkit option."""
    offload_frozen: bool = True
    """On an accelerator, keep the frozen reference and snapshot in CPU memory while the student
    trains, so an inner step holds only the student and the cache."""


@dataclass
class AnchorCache:
    """Top-k of q_t for every completion token of the task data, rows in example order."""

    values: torch.Tensor  # (N, k) float32 log q
    indices: torch.Tensor  # (N, k) token ids, int16/int32
    tail: torch.Tensor  # (N,) float32 log of q's mass outside the top-k
    offsets: list[int]  # example i owns rows offsets[i]:offsets[i + 1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.indices, self.tail))

    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        spans = [(self.offsets[i], self.offsets[i + 1]) for i in index.tolist()]
        pick = torch.cat([torch.arange(a, b) for a, b in spans]).to(self.values.device)
        return self.values[pick], self.indices[pick], self.tail[pick]


def completion_mask(batch: Batch) -> torch.Tensor:
    """Positions whose next token is a completion token (the ones the loss sees)."""
    return batch["labels"][:, 1:] != IGNORE_INDEX


def completion_logprobs(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``(n, V)`` float32 log-probabilities at the batch's completion positions, row-major.

    Through ``teacher_forced_logits``: logits over the completion window only, and the tokens
    every row shares (a chat template's system turn) run once, so forming an anchor on a real
    model does not pay the output layer and the system turn for every row."""
    logits, labels = teacher_forced_logits(model, batch)
    return torch.log_softmax(logits[:, :-1][labels[:, 1:] != IGNORE_INDEX].float(), dim=-1)


def anchor_loss(cache: AnchorCache) -> LossFn:
    """The inner loss: mean over the batch's completion tokens of KL(q_t ‖ p_θ) from the cache."""

    def loss(batch: Batch, outputs: Any, ctx: StepContext) -> torch.Tensor:
        mask = completion_mask(batch)
        values, indices, tail = cache.rows(batch["index"])
        if int(mask.sum()) != values.size(0):
            raise TrainingError(
                f"task {ctx.task.task.name!r}: batch has {int(mask.sum())} completion tokens, "
                f"the anchor cache {values.size(0)}"
            )
        if values.size(0) == 0:
            return outputs.logits.sum() * 0.0
        logp = torch.log_softmax(outputs.logits[:, :-1][mask].float(), dim=-1)
        return cached_anchor_kl(logp, values, indices, tail).mean()

    return loss


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@declare_method(
    AnchoredConfig, capabilities={Capability.TRAIN_STAGE}, paper=cite("anchored_learning")
)
class Anchored(Method[AnchoredConfig]):
    """Anchored Learning ("Stabilizing LLM Supervised Fine-Tuning via Explicit Distributional
    Control"; summary in shared/papers/002). Per task: a frozen SFT reference p_sft (trained once
    on the task data through the shared loop, or loaded); then T outer iterations, each forming
    the anchor q_t = I_α(p_θ(t), p_sft) (logit or probability space, ``anchored_math``) and
    fitting the student to it by minimising KL(q_t ‖ p_θ) for K inner epochs (or
    ``inner_steps``). Each step then moves at most a bounded KL away from the previous model.

    The anchor is fixed within an outer iteration and so is the data, so q_t is computed once per
    iteration (a no-grad pass of the student and the reference over the task's completion
    tokens) and cached as its top-k plus a tail mass: an inner step is one forward and backward
    of the student, like plain SFT. ``TrainStats.details`` records, per iteration, the bound at
    θ(t), the anchor's KL(q_t ‖ p_θ(t)), the realised step KL(p_θ(t+1) ‖ p_θ(t)) and the fit
    residual KL(q_t ‖ p_θ(t+1)) (token means over the task data), and the cost of each part.
    Nothing is kept across tasks: a resumed run rebuilds the same reference from its checkpoint.
    """

    smoke: ClassVar[dict[str, Any]] = {"outer_iterations": 2, "inner_steps": 2, "top_k": 8}
    unquantized = "keeps whole copies of the model (its SFT reference and snapshots)"
    unsharded = None  # its reference and snapshots are split like the student (copy_model)

    def __init__(self, config: AnchoredConfig) -> None:
        super().__init__(config)

    def train_task(self, stage: Stage) -> TrainStats:
        cfg, ctx, start = self.config, stage.ctx, time.perf_counter()
        if cfg.alpha == 0.0:
            # q_t = p_θ(t): the student already is its anchor; an optimizer fed rounding noise
            # would still move the weights, so nothing is trained.
            return TrainStats(details={"skipped": "alpha = 0: the anchor is the student itself"})
        if cfg.student_init == "base" and ctx.run.finetune_mode != "full":
            raise ConfigError("method.student_init: base needs finetune.mode: full")
        reference, ref_stats, ref_info = self._reference(stage)
        if cfg.student_init == "base":
            self._reset_to_base(ctx)
        features = [{**f, "index": [i]} for i, f in enumerate(ctx.train_features)]
        plan = stage.plan
        inner_steps = cfg.inner_steps or steps_for_epochs(
            len(features), plan.batch_size, plan.grad_accum, cfg.inner_epochs
        )
        iterations: list[dict[str, Any]] = []
        inner: list[TrainStats] = []
        seconds = {"cache": 0.0, "inner": 0.0}
        snapshot: nn.Module | None = None
        for t in range(1, cfg.outer_iterations + 1):
            tick = time.perf_counter()
            order = _shuffled(features, plan.seed, t)
            pool = features  # what the anchor is formed over; the inner steps draw from order
            if cfg.anchor_pool == "drawn":
                pool = order = drawn_pool(order, inner_steps * plan.batch_size * plan.grad_accum)
            cache, sums = self._pass(stage, pool, reference, snapshot, build=True)
            assert cache is not None
            seconds["cache"] += time.perf_counter() - tick
            if snapshot is not None:  # the pass also measured the iteration that just ended
                iterations[-1].update(_measured(sums))
            iterations.append(
                {
                    "t": t,
                    "bound": _finite(sums["bound"]),
                    "anchor_kl": sums["anchor_kl"],
                    "tail_mass": sums["tail_mass"],
                }
            )
            if cfg.measure:
                snapshot = self._snapshot(ctx, snapshot)
            tick = time.perf_counter()
            stats = stage.sft(
                features=order,
                loss_fn=anchor_loss(cache),
                steps=inner_steps,
                label=f"anchor {t}/{cfg.outer_iterations}",
            )
            seconds["inner"] += time.perf_counter() - tick
            iterations[-1].update(inner_steps=stats.steps, inner_final_loss=stats.final_loss)
            inner.append(stats)
            cache_bytes, cache_tokens = cache.nbytes, cache.values.size(0)
            del cache
        tick = time.perf_counter()
        if snapshot is not None:  # over the last anchor's pool
            _, sums = self._pass(stage, pool, reference, snapshot, build=False)
            iterations[-1].update(_measured(sums))
        seconds["measure"] = time.perf_counter() - tick
        vocab = _vocab_size(ctx.model)
        details = {
            "alpha": cfg.alpha,
            "space": cfg.space,
            "top_k": min(cfg.top_k, vocab),
            "exact_cache": cfg.top_k >= vocab,
            "cache_bytes_per_token": cache_bytes_per_token(cfg.top_k, vocab),
            "cache_bytes": cache_bytes,
            "cache_tokens": cache_tokens,
            "reference": ref_info,
            "iterations": iterations,
            "cost": {
                "reference_steps": ref_stats.steps if ref_stats else 0,
                "inner_steps": sum(s.steps for s in inner),
                "reference_seconds": round(ref_info.get("seconds", 0.0), 3),
                **{f"{k}_seconds": round(v, 3) for k, v in seconds.items()},
                "total_seconds": round(time.perf_counter() - start, 3),
            },
        }
        return _total(ref_stats, inner, time.perf_counter() - start, details)

    def _reference(self, stage: Stage) -> tuple[nn.Module, TrainStats | None, dict[str, Any]]:
        """The frozen p_sft of this task: loaded, or SFT of a copy on the task's own plan."""
        cfg, ctx = self.config, stage.ctx
        tick = time.perf_counter()
        if cfg.reference_path is not None:
            path = cfg.reference_path.format(task=ctx.task.name, index=ctx.task_index)
            dtype = next(ctx.model.parameters()).dtype
            try:
                loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            except (OSError, ValueError) as err:
                raise ModelLoadError(
                    f"method.reference_path: cannot load {path!r}: {str(err).strip()[:200]}"
                ) from None
            ref = self._park(freeze(loaded))
            return ref, None, {"loaded_from": path, "seconds": time.perf_counter() - tick}
        if cfg.reference_from == "base":
            ref = _split_like_student(_base(ctx), ctx.model)
        else:
            ref = copy_model(ctx)
        stats = stage.sft(model=ref, label="reference")
        ref = self._park(freeze(ref))
        info = {
            "trained_from": cfg.reference_from,
            "steps": stats.steps,
            "final_loss": stats.final_loss,
            "seconds": time.perf_counter() - tick,
        }
        return ref, stats, info

    def _reset_to_base(self, ctx: TaskContext) -> None:
        base = _base(ctx)
        if sharding.is_sharded(ctx.model):
            sharding.load_full_state(ctx.model, base.state_dict(), "the base model")
            return
        with torch.no_grad():
            ctx.model.load_state_dict(base.state_dict())

    def _snapshot(self, ctx: TaskContext, old: nn.Module | None) -> nn.Module:
        """A frozen copy of the student as it is now (θ(t)), reusing the last one's storage."""
        if old is None:
            return self._park(freeze(copy_model(ctx)))
        sharding.copy_shards(ctx.model, old)
        return old

    def _park(self, module: nn.Module) -> nn.Module:
        parked = self.config.offload_frozen and not sharding.is_sharded(module)
        return module.to("cpu") if parked else module

    @contextlib.contextmanager
    def _on(self, module: nn.Module | None, device: torch.device) -> Iterator[None]:
        """Bring a parked frozen model to the device for one pass, and park it again after."""
        if module is not None:
            module.to(device)
        try:
            yield
        finally:
            if module is not None:
                self._park(module)

    @torch.no_grad()
    def _pass(
        self,
        stage: Stage,
        features: list[Features],
        reference: nn.Module,
        snapshot: nn.Module | None,
        build: bool,
    ) -> tuple[AnchorCache | None, dict[str, float]]:
        """One no-grad pass over the task data: the cache of q_t (if ``build``), the bound and
        anchor KL at the student's current θ, and, given the snapshot θ(t−1), the realised step
        and residual of the iteration that just ended. Sums are token means."""
        cfg, ctx = self.config, stage.ctx
        model, size = ctx.model, cfg.cache_batch_size or stage.plan.batch_size
        keys = ("bound", "anchor_kl", "tail_mass", "step_kl", "residual_kl")
        sums, tokens = dict.fromkeys(keys, 0.0), 0
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        offsets = [0]
        model.eval()
        with self._on(reference, ctx.device), self._on(snapshot, ctx.device):
            for lo in range(0, len(features), size):
                batch = collate(features[lo : lo + size], ctx.tokenizer.pad_token_id)
                batch = {k: v.to(ctx.device) for k, v in batch.items()}
                logp, logp_sft = (
                    completion_logprobs(model, batch),
                    completion_logprobs(reference, batch),
                )
                logq = anchor_logprobs(logp, logp_sft, cfg.alpha, cfg.space)
                tokens += logp.size(0)
                sums["bound"] += float(kl_bound(logp, logp_sft, cfg.alpha, cfg.space).sum())
                sums["anchor_kl"] += float(kl_per_position(logq, logp).sum())
                if build:
                    values, indices, tail = topk_anchor(logq, cfg.top_k)
                    parts.append((values, indices.to(index_dtype(logp.size(-1))), tail))
                    sums["tail_mass"] += float(tail.exp().sum())
                    offsets.extend((offsets[-1] + completion_mask(batch).sum(1).cumsum(0)).tolist())
                if snapshot is not None:
                    logp_prev = completion_logprobs(snapshot, batch)
                    logq_prev = anchor_logprobs(logp_prev, logp_sft, cfg.alpha, cfg.space)
                    sums["step_kl"] += float(kl_per_position(logp, logp_prev).sum())
                    sums["residual_kl"] += float(kl_per_position(logq_prev, logp).sum())
        means = {k: v / max(tokens, 1) for k, v in sums.items()}
        if not build:
            return None, means
        cache = AnchorCache(
            values=torch.cat([p[0] for p in parts]),
            indices=torch.cat([p[1] for p in parts]),
            tail=torch.cat([p[2] for p in parts]),
            offsets=[int(o) for o in offsets],
        )
        return cache, means


def _base(ctx: TaskContext) -> nn.Module:
    return ctx.run.base_loader("anchored")().to(ctx.device)


def _split_like_student(model: nn.Module, student: nn.Module) -> nn.Module:
    """``model`` split over the processes as the student is (on a sharded run), else as is."""
    if sharding.is_sharded(student):
        sharding.shard_model(model)
    return model


def copy_model(ctx: TaskContext) -> nn.Module:
    """A copy of the student: ``deepcopy``, which FSDP2 refuses, so on a sharded run the base
    split alike with the student's shards copied in."""
    if not sharding.is_sharded(ctx.model):
        return copy.deepcopy(ctx.model)
    copied = _split_like_student(_base(ctx), ctx.model)
    sharding.copy_shards(ctx.model, copied)
    return copied


def _measured(sums: dict[str, float]) -> dict[str, float]:
    return {"step_kl": sums["step_kl"], "residual_kl": sums["residual_kl"]}


def drawn_pool(order: list[Features], examples: int) -> list[Features]:
    """The first ``examples`` of a shuffled task pool, re-indexed as the rows of their own
    anchor cache (the whole pool when it is smaller)."""
    return [{**f, "index": [i]} for i, f in enumerate(order[:examples])]


def _shuffled(features: list[Features], seed: int, t: int) -> list[Features]:
    """A fresh order per outer iteration (each inner loop's sampler restarts from one seed)."""
    order = torch.randperm(len(features), generator=torch.Generator().manual_seed(seed * 97 + t))
    return [features[i] for i in order.tolist()]


def _vocab_size(model: nn.Module) -> int:
    out = model.get_output_embeddings()  # type: ignore[operator]
    return int(out.weight.size(0))


def _total(
    ref: TrainStats | None, inner: list[TrainStats], seconds: float, details: dict[str, Any]
) -> TrainStats:
    """The task's stats: every optimizer step (reference and inner), all wall time."""
    steps = sum(s.steps for s in inner)
    terms = {"anchor_kl": sum(s.loss_terms.get("task", 0.0) * s.steps for s in inner) / steps}
    if ref is not None:
        terms["reference_sft"] = ref.loss_terms.get("task", float("nan"))
    return TrainStats(
        steps=steps + (ref.steps if ref else 0),
        seconds=seconds,
        tokens=sum(s.tokens for s in inner) + (ref.tokens if ref else 0),
        final_loss=inner[-1].final_loss,
        loss_terms=terms,
        peak_memory_mb=peak_memory_mb(),
        details=details,
        losses=[*(ref.losses if ref else []), *(x for s in inner for x in s.losses)],
    )
