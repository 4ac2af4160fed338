"""SAE-FD: feature distillation toward past tasks' anchors in a frozen gated SAE's feature space.

Zhang et al. 2026, "SAE-FD: Sparse Autoencoder Feature Distillation for Continual Learning of
Large Language Models" (summary in shared/papers/001). The SAE is the gated SAE of Rajamanoharan
et al. 2024, "Improving Dictionary Learning with Gated Sparse Autoencoders" (``forgetless.sae``).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from forgetless.contract.hooks import Batch, MethodState, StepContext, TaskContext, TaskEndContext
from forgetless.contract.method import Capability, Knob, Method, MethodConfig, declare_method
from forgetless.core import distributed
from forgetless.core.dtypes import DTYPES
from forgetless.core.fields import Count, Positive
from forgetless.engine.loop import causal_lm_loss
from forgetless.errors import ConfigError
from forgetless.methods.papers import cite
from forgetless.sae.activations import (
    MLPTap,
    TrainedSAE,
    default_sae_sources,
    ensure_sae,
    later_tokens,
    model_fingerprint,
    shared_sae_dir,
    token_outputs,
)
from forgetless.sae.gated import GatedSAE, encode, load_sae, read_sae_record
from forgetless.sae.train import SAETrainConfig
from forgetless.tasks.formatting import IGNORE_INDEX, Features, collate

AnchorDtype = Literal["float16", "bfloat16", "float32"]
FP16_MAX = 65504.0

# --- the distillation loss ---------------------------------------------------------------------


def cosine_loss(f_pre: Tensor, f_pre_anchor: Tensor, eps: float = 1e-8) -> Tensor:
    """``L_cos = mean_tokens (1 − cos(f_pre, f_pre_anchor))`` over the last dimension.

    Zero when the current and anchor pre-activation vectors point the same way, whatever their
    lengths (scale-invariant): it holds the direction of the whole feature vector.
    """
    return (1.0 - F.cosine_similarity(f_pre.float(), f_pre_anchor.float(), dim=-1, eps=eps)).mean()


def active_magnitude_loss(value: Tensor, f_anchor: Tensor) -> Tensor:
    """``L_mag``: mean squared difference over the features active in the anchor (``f_anchor > 0``)
    only; every other entry is masked out, so its gradient is exactly zero.

    ``value`` is the current model's magnitude-path pre-activation ``π_mag`` (see ``SAEFD``): on an
    anchor-active feature ``f_anchor = π_mag_anchor``, so the two agree wherever the current
    feature is also active, and the loss keeps a gradient where the current gate has closed.
    """
    active = f_anchor > 0
    if not bool(active.any()):
        return value.sum() * 0.0
    diff = torch.where(active, value.float() - f_anchor.float(), torch.zeros_like(value.float()))
    return diff.pow(2).sum() / active.sum()


def dense_mse(h: Tensor, h_anchor: Tensor) -> Tensor:
    """The ablation without an SAE: MSE between current and anchor MLP outputs."""
    return (h.float() - h_anchor.float()).pow(2).mean()


class FDParts(NamedTuple):
    """``L_FD`` (with its graph) and its two SAE terms (detached; zero in the dense space)."""

    total: Tensor
    l_cos: Tensor
    l_mag: Tensor


def feature_distillation(
    sae: GatedSAE | None, h: Tensor, h_anchor: Tensor, terms: str, space: str
) -> FDParts:
    """``L_FD`` between the current MLP outputs ``h`` and the anchors ``h_anchor`` (``(T, d)``).

    ``sae``: the paper's loss on the SAE's features. ``dense``: the same two-term form on ``h``
    itself (``L_cos`` on ``h``, ``L_mag`` over every coordinate, all of them being "active"), so
    the ablation changes only the space. ``dense_mse``: one MSE on ``h`` (the loss form changes
    too).
    """
    if space == "dense_mse":
        loss = dense_mse(h, h_anchor)
        zero = loss.detach() * 0.0
        return FDParts(loss, zero, zero)
    if space == "dense":
        value, reference = h, h_anchor.to(h.dtype)
        l_cos = cosine_loss(value, reference)
        l_mag = dense_mse(value, reference)
    else:
        assert sae is not None, "the SAE space needs an SAE"
        current = encode(sae, h)
        with torch.no_grad():
            anchor = encode(sae, h_anchor)
        l_cos = cosine_loss(current.pi_mag, anchor.pi_mag)
        l_mag = active_magnitude_loss(current.pi_mag, anchor.f)
    parts = {"cos": l_cos, "mag": l_mag}
    total = torch.stack([parts[t] for t in terms.split("+")]).sum()
    return FDParts(total, l_cos.detach(), l_mag.detach())


# --- the adaptive weight -------------------------------------------------------------------------


def target_lambda(
    task_loss: float, fd_loss: float, rho: float, lam_min: float, lam_max: float
) -> float:
    """``λ* = ρ/(1−ρ) · L_task / L_FD``: the λ at which ``λL_FD / (λL_FD + L_task) = ρ``, clipped
    to ``[λ_min, λ_max]``.

    Guard: λ* is unbounded as ``L_FD → 0`` (the first steps of a task, when the model still equals
    its anchors), so an ``L_FD`` at or below ``1e-12 · max(1, L_task)`` (or a non-finite ratio)
    gives ``λ_max``, the limit the clip would give; a non-positive task loss gives ``λ_min``.
    """
    if not math.isfinite(task_loss) or task_loss <= 0:
        return lam_min
    if not math.isfinite(fd_loss) or fd_loss <= 1e-12 * max(1.0, task_loss):
        return lam_max
    target = rho / (1.0 - rho) * task_loss / fd_loss
    return min(lam_max, max(lam_min, target)) if math.isfinite(target) else lam_max


def ema_lambda(
    lam: float,
    task_loss: float,
    fd_loss: float,
    rho: float,
    rate: float,
    lam_min: float,
    lam_max: float,
) -> float:
    """One EMA step ``λ ← (1−η)·λ + η·λ*`` toward the clipped target (stays in the clip range)."""
    return (1.0 - rate) * lam + rate * target_lambda(task_loss, fd_loss, rho, lam_min, lam_max)


def distill_share(lam: float, fd_loss: float, task_loss: float) -> float:
    """The measured share ``ρ = λL_FD / (λL_FD + L_task)``."""
    total = lam * fd_loss + task_loss
    return lam * fd_loss / total if total > 0 else 0.0


# --- the anchor buffer ---------------------------------------------------------------------------


def id_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest signed integer type that holds every token id."""
    return torch.int16 if vocab_size <= 2**15 else torch.int32


@dataclass
class AnchorBuffer:
    """Anchor inputs and per-token MLP outputs of every past task, flat.

    ``ids`` and ``h`` hold every anchor token in order (``h`` in the storage dtype); ``lengths``
    gives each anchor sample's token count (its attention mask is ``lengths`` ones, so masks are
    not stored) and ``tasks`` its 1-based task index.
    """

    ids: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    h: Tensor = field(default_factory=lambda: torch.zeros(0, 0))
    lengths: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    tasks: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))
    _starts: list[int] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.lengths.numel())

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.ids, self.h, self.lengths, self.tasks)
        )

    def append(self, ids: Tensor, h: Tensor, lengths: Tensor, task: int) -> None:
        if len(self) == 0:
            self.ids, self.h = ids, h
        else:
            self.ids, self.h = torch.cat([self.ids, ids]), torch.cat([self.h, h])
        self.lengths = torch.cat([self.lengths, lengths.to(torch.int32)])
        self.tasks = torch.cat([self.tasks, torch.full_like(lengths, task, dtype=torch.int32)])
        self._starts = None

    def starts(self) -> list[int]:
        """Where each anchor sample's tokens begin in ``ids`` and ``h`` (cached)."""
        if self._starts is None:
            self._starts = [0, *torch.cumsum(self.lengths.long(), 0).tolist()[:-1]]
        return self._starts

    def as_features(self, rows: list[int]) -> tuple[list[Features], Tensor]:
        """Anchor samples ``rows`` as training features with no labelled token (they add nothing
        to a cross-entropy) and their stored outputs ``(tokens, d)``, in the same order."""
        starts, lengths = self.starts(), self.lengths[rows].tolist()
        feats: list[Features] = []
        targets = []
        for row, n in zip(rows, lengths, strict=True):
            a = starts[row]
            feats.append({"input_ids": self.ids[a : a + n].tolist(), "labels": [IGNORE_INDEX] * n})
            targets.append(self.h[a : a + n])
        return feats, torch.cat(targets)

    def gather(
        self, rows: list[int], pad_id: int, device: torch.device
    ) -> tuple[dict[str, Tensor], Tensor]:
        """A right-padded input batch of anchor samples ``rows`` and their stored outputs
        ``(tokens, d)``, in the order the batch's mask selects them."""
        feats, targets = self.as_features(rows)
        batch = collate(feats, pad_id)
        inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask")}
        return inputs, targets.to(device)

    def state(self) -> dict[str, Tensor]:
        return {"ids": self.ids, "h": self.h, "lengths": self.lengths, "tasks": self.tasks}

    @classmethod
    def from_state(cls, state: dict[str, Tensor]) -> AnchorBuffer:
        return cls(state["ids"], state["h"], state["lengths"], state["tasks"])


def anchor_bytes_per_token(d: int, dtype: torch.dtype, vocab_size: int) -> int:
    """Bytes stored per anchor token: its ``d`` MLP outputs and its token id."""
    return (
        d * torch.empty(0, dtype=dtype).element_size()
        + torch.empty(0, dtype=id_dtype(vocab_size)).element_size()
    )


# --- the method ------------------------------------------------------------------------------


class SAEFDConfig(MethodConfig):
    name: Literal["sae_fd"] = "sae_fd"
    """Feature distillation in SAE space."""
    anchor_samples: Count = 128
    """N_a, anchor samples captured per finished task (training examples). The paper's summary calls
    the set small without a number."""
    anchor_batch_fraction: float = Field(0.25, gt=0, le=4)
    """Anchor samples drawn per step, as a fraction of the task micro-batch (0.25: a quarter)."""
    anchor_dtype: AnchorDtype = "float16"
    """Storage type of the anchors' MLP outputs: float16 is half of float32's bytes (bfloat16 for
    models whose MLP outputs exceed float16's range)."""
    terms: Literal["cos+mag", "cos", "mag"] = "cos+mag"
    """L_FD = L_cos + L_mag (the paper), or one term (ablations)."""
    space: Literal["sae", "dense", "dense_mse"] = "sae"
    """sae: distil through the frozen SAE (the paper); dense: the same L_cos + L_mag form on the MLP
    outputs themselves (every coordinate active: only the space changes); dense_mse: one raw MSE
    on the MLP outputs (the loss form changes too). The dense spaces need no SAE."""
    adaptive: bool = True
    """Steer λ by an EMA toward the share rho (the paper); false: fixed λ."""
    lam_start: Literal["max", "carry"] = "max"
    """Adaptive λ at a task's start: max = lam_max, then the EMA relaxes it as L_task falls (the
    paper: λ high when a task starts, when forgetting is likeliest); carry = the value the last
    task ended with."""
    lam: Positive = 1.0
    """λ when adaptive is false (the paper's fixed-λ ablation uses 1.0), and the starting λ of the
    EMA."""
    rho: float = Field(0.15, gt=0, lt=1)
    """Target share ρ = λL_FD / (λL_FD + L_task); 0.15 from a public description of the paper."""
    ema: float = Field(0.05, gt=0, le=1)
    """EMA rate η of λ ← (1−η)λ + ηλ*; 0.05 (same source)."""
    lam_min: Positive = 0.2
    """Lower clip of λ; 0.2 (same source)."""
    lam_max: Positive = 10.0
    """Upper clip of λ; 10 (same source)."""
    sae_path: str | None = None
    """Folder with sae.safetensors + sae_config.json (from `forgetless sae train`); null: train one
    on the run's base model at first use and cache it."""
    sae_cache: Literal["shared", "run"] = "shared"
    """Where an SAE trained at first use is kept: shared = $FORGETLESS_CACHE/sae/<base model +
    settings> (reused by every run on that base), run = <out>/sae."""
    sae: SAETrainConfig = Field(
        default_factory=SAETrainConfig,  # type: ignore[arg-type]
        description="How that SAE is trained (expansion, λ_sparse, steps, data).",
    )
    anchor_forward: Literal["fold", "separate"] = "fold"
    """fold: the step's anchor samples join the task micro-batch (no labelled token, so the
    cross-entropy is unchanged) and one forward pass serves both; separate: a second forward on
    the anchors that stops at the last MLP, cheaper when the LM head dominates a step (very large
    vocabularies). The loss is the same either way."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seed of the anchor choice and draws (with the run's)."""


@declare_method(
    SAEFDConfig,
    capabilities={
        Capability.BATCH_TRANSFORM,
        Capability.ACTIVATION_HOOKS,
        Capability.LOSS_TERMS,
        Capability.TASK_END,
        Capability.STATE,
    },
    paper=cite("zhang2026"),
)
class SAEFD(Method[SAEFDConfig]):
    """SAE-FD (Zhang et al. 2026, "SAE-FD: Sparse Autoencoder Feature Distillation for Continual
    Learning of Large Language Models"): hold past tasks' last-layer MLP outputs in place in the
    sparse feature space of a frozen gated SAE, so that only the features old tasks used are
    anchored and inactive ones stay free for the new task.

    - **SAE**: a gated SAE (``forgetless.sae``) on the base model's last-layer MLP outputs, loaded
      from ``sae_path`` or trained once on the run's base model and cached.
    - **Anchors**: when a task ends, ``anchor_samples`` of its training examples (token ids) and
      the trained model's per-token MLP outputs on them (``anchor_dtype``, float16 by default)
      join a buffer kept across tasks.
    - **Distillation**: each step draws ``anchor_batch_fraction`` × the micro-batch anchor samples
      uniformly from the buffer (cost independent of the number of past tasks), runs the current
      model on them (by default appended to the micro-batch without labels, so the task's forward
      pass gives their last-MLP outputs too; ``anchor_forward: separate`` re-runs the model on
      them up to the last MLP instead) and adds ``λ·L_FD``, ``L_FD = L_cos + L_mag``, as the loss
      term ``sae_fd``.
    - ``f_pre`` is the magnitude path's pre-activation ``π_mag``: it is the path that carries
      feature magnitudes and is untouched by the L1 penalty (which shapes ``π_gate``), and it
      shares ``π_gate``'s directions. ``L_cos`` compares current and anchor ``π_mag`` vectors over
      all features; ``L_mag`` is an MSE over the anchor-active features (``f > 0``) between the
      current ``π_mag`` and the anchor's ``f`` (equal to its ``π_mag`` there). Taking ``π_mag``
      rather than the gated ``f`` keeps a gradient where the current gate has closed, and since
      both paths project on the same direction, pulling ``π_mag`` back also reopens the gate.
    - **Adaptive λ**: ``λ ← (1−η)λ + η·clip(λ*)``, ``λ* = ρ/(1−ρ)·L_task/L_FD``, updated with each
      micro-batch's losses before weighting it; ``L_FD ≈ 0`` gives λ* = ``lam_max``. Each task
      starts at ``lam_max`` (``lam_start: max``), so λ is high while ``L_task`` is large and
      relaxes as the task converges, as the paper describes.

    λ, L_cos, L_mag, L_FD and the measured share are recorded per micro-batch and land in
    ``results.json`` under the task's ``details.sae_fd`` (only the weighted term is a named loss
    term, so the runner's total stays the true loss). The buffer and λ are the method's state.
    """

    knob = Knob(
        "rho", keeps_more="higher", low=0.01, high=0.95
    )  # budget: ρ, the target share of the distillation loss (λ adapts toward it)
    smoke: ClassVar[dict[str, Any]] = {"sae_cache": "run", "sae": {"steps": 20, "n_per_task": 4}}
    unsharded = None  # its state is activations; every process draws and scores the same ones
    tail_logits_ok = True  # it reads the task rows' logits for λ only, labels aligned by the tail

    def __init__(self, config: SAEFDConfig) -> None:
        super().__init__(config)
        self.lam = self.config.lam
        self.buffer = AnchorBuffer()
        self.sae: GatedSAE | None = None
        self.sae_info: dict[str, Any] | None = None
        self.tap = MLPTap()
        self.trace: dict[str, list[float]] = _empty_trace()
        self._step_key: tuple[int, int] | None = None
        self._micro = 0
        self._folded: tuple[int, Tensor] | None = None
        """(task rows, anchor targets) of the micro-batch ``transform_batch`` extended."""

    # --- hooks ---

    def transform_batch(self, features: list[Features], ctx: StepContext) -> list[Features]:
        """Append the micro-batch's anchor samples (``anchor_forward: fold``), and have the tap
        record the last MLP's output of the forward pass that follows."""
        self._folded = None
        if not len(self.buffer) or not self._folds():
            return features
        anchors, targets = self.buffer.as_features(self._draw(len(features), ctx))
        self._folded = (len(features), targets)
        self.tap.recording = True
        return [*features, *anchors]

    def register_hooks(self, ctx: TaskContext) -> list[torch.utils.hooks.RemovableHandle]:
        self.trace = _empty_trace()
        if self.config.adaptive and self.config.lam_start == "max":
            self.lam = self.config.lam_max
        if len(self.buffer) and self.config.space == "sae" and self.sae is None:
            self.sae = self._load_sae(ctx).to(ctx.device)
        self.tap = MLPTap()
        return [self.tap.register(ctx.model)]

    def loss_terms(self, batch: Batch, outputs: Any, ctx: StepContext) -> dict[str, Tensor]:
        if not len(self.buffer):
            return {"sae_fd": outputs.logits.new_zeros((), dtype=torch.float32)}
        n, h, h_anchor = self._anchor_outputs(batch, ctx)
        if self.sae is not None and h.size(-1) != self.sae.d_in:
            raise ConfigError(
                f"sae_fd: the SAE encodes d={self.sae.d_in}, the model's MLP outputs d={h.size(-1)}"
            )
        parts = feature_distillation(self.sae, h, h_anchor, self.config.terms, self.config.space)
        with torch.no_grad():
            logits = outputs.logits[:n]
            task_loss_t = causal_lm_loss(logits, batch["labels"][:n, -logits.size(1) :])
            logged = torch.stack([parts.total.detach(), parts.l_cos, parts.l_mag, task_loss_t])
        # Every process draws the same anchors (their terms agree everywhere); the task loss
        # is a token mean of this process's slice: weighted by the shares, all are global.
        logged = distributed.weighted_sum(logged, ctx.batch_share)
        fd, l_cos, l_mag, task_loss = logged.float().tolist()  # one device sync
        if self.config.adaptive:
            c = self.config
            self.lam = ema_lambda(self.lam, task_loss, fd, c.rho, c.ema, c.lam_min, c.lam_max)
        lam = self.lam if self.config.adaptive else self.config.lam
        for key, value in (
            ("lambda", lam),
            ("l_cos", l_cos),
            ("l_mag", l_mag),
            ("l_fd", fd),
            ("share", distill_share(lam, fd, task_loss)),
        ):
            self.trace[key].append(value)
        return {"sae_fd": lam * parts.total}

    def on_task_end(self, ctx: TaskEndContext) -> None:
        task = ctx.task
        added = self.capture_anchors(task)
        details: dict[str, Any] = {
            "anchors": added,
            "buffer": {"samples": len(self.buffer), "bytes": self.buffer.nbytes},
            "lambda_end": self.lam if self.config.adaptive else self.config.lam,
        }
        if self.trace["lambda"]:
            details["mean"] = {k: _round(sum(v) / len(v)) for k, v in self.trace.items()}
            details.update({k: [_round(x) for x in v] for k, v in self.trace.items()})
        if self.sae_info is not None:
            details["sae"], self.sae_info = self.sae_info, None
        ctx.stats.details["sae_fd"] = details

    def state_dict(self) -> MethodState:
        state: MethodState = {"lam": self.lam}
        if len(self.buffer):
            state["anchors"] = self.buffer.state()
        if self.trace["lambda"]:  # the task's per-step record, for a resume inside the task
            state["trace"] = {k: list(v) for k, v in self.trace.items()}
        return state

    def load_state_dict(self, state: MethodState) -> None:
        self.lam = float(state.get("lam", self.config.lam))
        anchors = state.get("anchors")
        self.buffer = AnchorBuffer.from_state(anchors) if anchors else AnchorBuffer()
        trace = state.get("trace")
        self.trace = {k: list(v) for k, v in trace.items()} if trace else _empty_trace()

    # --- parts ---

    @torch.no_grad()
    def capture_anchors(self, ctx: TaskContext) -> dict[str, Any]:
        """Add ``anchor_samples`` of the task's training examples, with the per-token MLP outputs
        of ``ctx.model`` on them, to the buffer; returns their sizes in samples, tokens, bytes."""
        model, tokenizer, features = ctx.model, ctx.tokenizer, ctx.train_features
        gen = torch.Generator().manual_seed(
            hash_seed("anchors", ctx.run.seed, self.config.seed, ctx.task_index)
        )
        order = torch.randperm(len(features), generator=gen)[: self.config.anchor_samples].tolist()
        chosen = [features[i] for i in order]
        dtype = DTYPES[self.config.anchor_dtype]
        tap, was_training = MLPTap(), model.training
        handle = tap.register(model)
        model.eval()
        outputs: list[Tensor] = []
        try:
            for lo in range(0, len(chosen), 32):
                batch = collate(chosen[lo : lo + 32], tokenizer.pad_token_id)
                batch = {k: v.to(ctx.device) for k, v in batch.items()}
                outputs.append(token_outputs(tap, model, batch).float().cpu())
        finally:
            handle.remove()
            model.train(was_training)
        h = torch.cat(outputs)
        if dtype == torch.float16 and float(h.abs().max()) > FP16_MAX:
            raise ConfigError(
                "sae_fd: MLP outputs exceed float16's range; set anchor_dtype: bfloat16"
            )
        ids = torch.tensor(
            [t for f in chosen for t in f["input_ids"]], dtype=id_dtype(len(tokenizer))
        )
        lengths = torch.tensor([len(f["input_ids"]) for f in chosen], dtype=torch.int32)
        before = self.buffer.nbytes
        self.buffer.append(ids, h.to(dtype), lengths, ctx.task_index)
        tokens = int(lengths.sum())
        return {
            "samples": len(chosen),
            "tokens": tokens,
            "d": int(h.size(-1)),
            "bytes": self.buffer.nbytes - before,
            "bytes_per_token": anchor_bytes_per_token(h.size(-1), dtype, len(tokenizer)),
            "float32_bytes_per_token": anchor_bytes_per_token(
                h.size(-1), torch.float32, len(tokenizer)
            ),
            "dtype": self.config.anchor_dtype,
        }

    def _anchor_outputs(self, batch: Batch, ctx: StepContext) -> tuple[int, Tensor, Tensor]:
        """The task rows of ``batch``, the current model's last-MLP outputs on this micro-batch's
        anchor tokens ``(tokens, d)`` and their stored targets (on the device), without each
        anchor's first token when the SAE was trained without it (``sae.skip_first``)."""
        task = ctx.task
        if not self._folds():
            rows = self._draw(ctx.global_batch_size or batch["input_ids"].size(0), ctx)
            inputs, h_anchor = self.buffer.gather(rows, task.tokenizer.pad_token_id, task.device)
            n, mask = batch["input_ids"].size(0), inputs["attention_mask"]
            h = token_outputs(self.tap, task.model, inputs)
        else:
            if self._folded is None:
                raise RuntimeError(
                    "sae_fd: loss_terms on a micro-batch transform_batch did not extend"
                )
            (n, h_anchor), self._folded = self._folded, None
            mask = batch["attention_mask"][n:]
            h, h_anchor = self.tap.take()[n:][mask.bool()], h_anchor.to(task.device)
        if self.config.sae.skip_first:
            keep = later_tokens(mask)
            h, h_anchor = h[keep], h_anchor[keep]
        return n, h, h_anchor

    def _folds(self) -> bool:
        """Fold the anchors into the task batch? Not over several processes: the loop splits
        the batch between them, while every process must see the whole anchor batch."""
        return self.config.anchor_forward == "fold" and distributed.world_size() == 1

    def _draw(self, batch_size: int, ctx: StepContext) -> list[int]:
        key = (ctx.task.task_index, ctx.step)
        self._micro = self._micro + 1 if key == self._step_key else 0  # grad-accum micro-batches
        self._step_key = key
        k = max(1, round(self.config.anchor_batch_fraction * batch_size))
        rng = random.Random(
            hash_seed("draw", ctx.task.run.seed, self.config.seed, *key, self._micro)
        )
        n = len(self.buffer)
        return rng.sample(range(n), k) if k <= n else rng.choices(range(n), k=k)

    def _load_sae(self, ctx: TaskContext) -> GatedSAE:
        if self.config.sae_path:
            folder = Path(self.config.sae_path)
            try:
                sae = load_sae(folder, ctx.device)
            except (FileNotFoundError, ValueError) as err:
                raise ConfigError(f"sae_fd.sae_path: {err}") from None
            self.sae_info = {
                "path": str(folder),
                "trained": False,
                **_summary(read_sae_record(folder)),
            }
            return sae
        load_base = ctx.run.base_loader(self.name)
        settings = self.config.sae
        if settings.tasks is None:  # the base's general data, not the sequence's own tasks
            settings = settings.model_copy(
                update={"tasks": default_sae_sources(ctx.run.task_names)}
            )
        if self.config.sae_cache == "run":
            folder = ctx.run.out_dir / "sae"
            base = None
        else:
            base = load_base()
            fingerprint = model_fingerprint(base, ctx.tokenizer)
            folder = shared_sae_dir(fingerprint, settings, ctx.run.max_length)
        loader = load_base if base is None else (lambda: base)
        got: TrainedSAE = distributed.main_first(
            lambda: ensure_sae(
                folder, loader, ctx.tokenizer, settings, ctx.run.max_length, ctx.device
            )
        )
        self.sae_info = {"path": str(got.folder), "trained": got.trained, **_summary(got.record)}
        return got.sae


def hash_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts``, stable across processes and Python versions."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _empty_trace() -> dict[str, list[float]]:
    return {"lambda": [], "l_cos": [], "l_mag": [], "l_fd": [], "share": []}


def _round(value: float) -> float:
    return float(f"{value:.6g}")


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    """The SAE's shape and held-out metrics, for the run's results."""
    return {
        "sae": record.get("sae"),
        "metrics": (record.get("metrics") or {}).get("eval"),
        "sources": sorted(record.get("sources") or {}),
    }
