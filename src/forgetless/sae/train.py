"""Training a gated SAE on a table of activations, and the metrics it is judged by."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from forgetless.core.fields import Count, Fraction, NonNegative, Positive
from forgetless.core.modules import freeze
from forgetless.sae.gated import (
    GatedSAE,
    GatedSAEConfig,
    encode,
    gated_sae_loss,
    init_for_training_,
    normalize_decoder_,
    reconstruct,
    remove_parallel_decoder_grad_,
)


class SAETrainConfig(BaseModel):
    """How the gated SAE is built and trained (on the base model's last-layer MLP outputs)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    expansion: Count = 8
    """Features per activation dimension: D = e·d."""
    l1_coeff: NonNegative = 0.4
    """λ_sparse on ‖ReLU(π_gate)‖₁, with activations scaled to E‖h‖² = 1. Chosen on synthetic data
    with a known dictionary (benchmarks/sae_recovery.py; d = 128, 8 of 1024 directions per
    vector, D = 1024, 2000 steps): 0.3 gave L0 11.9, 0.4 L0 9.0 with 987/1024 directions
    recovered, 0.5 L0 7.3. On the tiny base 0.4 gives EV 0.95 at L0 2.7, 0.2 EV 0.976 at L0 6.3
    (docs/sae_fd.md). Tune per model."""
    steps: Count = 3000
    """Adam steps."""
    batch_size: Count = 1024
    """Activation vectors (tokens) per step."""
    lr: Positive = 1e-3
    """Adam learning rate (constant after warm-up)."""
    l1_warmup: Fraction = 0.05
    """Share of the steps over which λ_sparse ramps up from 0."""
    encoder_init_norm: Positive = 0.1
    """Norm of the encoder rows at step 0 (W_gate = this · W_decᵀ, unit-norm decoder columns): short
    rows start the code near zero instead of dense."""
    grad_clip: NonNegative = 1.0
    """Clip the gradient's total norm to this before each step; 0: off."""
    n_per_task: Count = 300
    """Examples per data source for the activations (train split)."""
    tasks: list[str | dict[str, Any]] | None = None
    """Data sources: built-in task names, or task entries as in a run config (jsonl / hf); null =
    every built-in task."""
    seed: int = 0
    """Seed of the SAE's initialisation, data and batch order."""
    skip_first: bool = False
    """Leave each example's first token out of the activations. On a chat model the template's first
    token is an attention sink: on SmolLM2-135M-Instruct its last-MLP output averages norm 6537
    against a median of 534 elsewhere, 66% of the squares on 1.6% of the tokens
    (studies/real_sae_sink.py), and an SAE spends itself on it. SAE-FD then leaves it out of L_FD
    too."""
    autocast: Literal["off", "bf16"] = "off"
    """bf16: the base's forward passes that collect the activations, and the SAE's own training
    steps, under bfloat16 autocast (float32 weights and Adam state), as a run with train.autocast
    bf16 computes them. The real track's SAE trained in 821.9 s this way and in 1312.8 s in
    float32, each beside two other jobs on the reference CPU (docs/real-track.md)."""

    def key_fields(self) -> dict[str, Any]:
        """The settings as the SAE cache key reads them: the options added after SAEs were
        first cached enter it only when set, so those SAEs keep their keys."""
        later = {"autocast": "off", "skip_first": False}
        unset = {name for name, default in later.items() if getattr(self, name) == default}
        return self.model_dump(mode="json", exclude=unset)

    def width(self, d_in: int) -> int:
        return self.expansion * d_in

    def precision(self, device: torch.device) -> AbstractContextManager[Any]:
        """The autocast context the collection and the training steps run in."""
        if self.autocast == "off":
            return nullcontext()
        return torch.autocast(device.type, torch.bfloat16)


@dataclass
class SAEMetrics:
    """Reconstruction error (mean squared, per element, in the activations' own units),
    explained variance ``1 − Σ‖h − ĥ‖² / Σ‖h − mean h‖²``, mean L0 (features firing per token) and
    the share of features that fire on no token of the data."""

    mse: float
    explained_variance: float
    l0: float
    dead_fraction: float
    tokens: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def sae_metrics(sae: GatedSAE, acts: Tensor, batch_size: int = 4096) -> SAEMetrics:
    """The four metrics of ``sae`` on ``acts`` (``(N, d)``), computed in chunks."""
    device = next(sae.parameters()).device
    n = acts.size(0)
    if n == 0:
        raise ValueError("sae_metrics needs at least one activation vector")
    mean = acts.float().mean(0).to(device)
    sq_err, total_var, active = 0.0, 0.0, 0.0
    fired = torch.zeros(sae.d_sae, dtype=torch.bool, device=device)
    for lo in range(0, n, batch_size):
        h = acts[lo : lo + batch_size].to(device).float()
        codes = encode(sae, h)
        h_hat = reconstruct(sae, h)
        sq_err += float((h - h_hat).pow(2).sum())
        total_var += float((h - mean).pow(2).sum())
        on = codes.f > 0
        active += float(on.sum())
        fired |= on.any(0)
    return SAEMetrics(
        mse=sq_err / (n * acts.size(1)),
        explained_variance=1.0 - sq_err / max(total_var, 1e-30),
        l0=active / n,
        dead_fraction=1.0 - float(fired.float().mean()),
        tokens=n,
    )


def sparse_synthetic_data(
    n: int,
    d: int,
    n_directions: int,
    active: int,
    noise: float = 0.01,
    magnitudes: tuple[float, float] = (0.5, 1.5),
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """Data with a known dictionary: ``(x, directions)``, ``x`` of shape ``(n, d)``.

    ``directions`` are ``n_directions`` random unit vectors in ``R^d`` (rows); each row of ``x``
    sums ``active`` of them, drawn without replacement, with magnitudes uniform in
    ``magnitudes``, plus Gaussian noise of standard deviation ``noise`` per element, and the
    whole table is scaled so that ``E‖x‖² = 1``. The toy setting in which SAEs are checked for
    recovering ground-truth features (Sharkey et al. 2022, "Taking features out of superposition
    with sparse autoencoders").
    """
    if not 1 <= active <= n_directions:
        raise ValueError(f"active must be in [1, {n_directions}], got {active}")
    gen = torch.Generator().manual_seed(seed)
    directions = torch.randn(n_directions, d, generator=gen)
    directions = directions / directions.norm(dim=1, keepdim=True)
    x = torch.empty(n, d)
    chunk = max(1, 2**22 // n_directions)
    lo_mag, hi_mag = magnitudes
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        idx = torch.rand(m, n_directions, generator=gen).argsort(dim=1)[:, :active]
        coeff = lo_mag + (hi_mag - lo_mag) * torch.rand(m, active, generator=gen)
        x[lo : lo + m] = torch.einsum("ma,mad->md", coeff, directions[idx])
    x += noise * torch.randn(n, d, generator=gen)
    return x / input_scale(x), directions


def direction_recovery(w_dec: Tensor, directions: Tensor) -> Tensor:
    """For each ground-truth direction (a row of ``directions``), the largest cosine similarity
    with any decoder column of ``w_dec`` (``(d, D)``): near 1 where a feature found it."""
    cols = w_dec.float() / w_dec.float().norm(dim=0, keepdim=True).clamp_min(1e-12)
    rows = directions.float() / directions.float().norm(dim=1, keepdim=True).clamp_min(1e-12)
    return (rows @ cols).max(dim=1).values


def input_scale(acts: Tensor) -> float:
    """The scale ``s`` with ``E‖h / s‖² = 1`` over the rows of ``acts``."""
    return max(float(acts.float().pow(2).sum(-1).mean().sqrt()), 1e-12)


def train_sae(
    acts: Tensor,
    cfg: SAETrainConfig,
    device: torch.device | str = "cpu",
    on_step: Callable[[float], None] | None = None,
) -> tuple[GatedSAE, list[dict[str, float]]]:
    """Train a gated SAE on ``acts`` (``(N, d)``, any float dtype, any device).

    Adam on the gated SAE loss (Rajamanoharan et al. 2024), with λ_sparse ramped linearly over
    the first ``l1_warmup`` share of the steps. The decoder columns are kept at unit norm as in
    the paper: each step drops the gradient's part along each column
    (``remove_parallel_decoder_grad_``), clips the gradient's total norm to ``grad_clip``, takes
    the Adam step and renormalises the columns. Training starts from short encoder rows parallel
    to the decoder columns (``init_for_training_``, ``encoder_init_norm``): from unit-norm rows
    the code starts dense and, on data with a known dictionary, no direction was recovered
    (issue 24; ``benchmarks/sae_recovery.py``). Deterministic under ``cfg.seed`` on one device.
    Returns the frozen SAE and a short loss history.
    """
    device = torch.device(device)
    data = acts.float().to(device)
    n, d_in = data.shape
    if n == 0:
        raise ValueError("train_sae needs at least one activation vector")
    scale = input_scale(data)
    sae = GatedSAE(
        GatedSAEConfig(d_in=d_in, d_sae=cfg.width(d_in), input_scale=scale), seed=cfg.seed
    ).to(device)
    init_for_training_(sae, data.mean(0) / scale, cfg.encoder_init_norm)
    optimizer = torch.optim.Adam(sae.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    warmup = max(1, round(cfg.l1_warmup * cfg.steps))
    history: list[dict[str, float]] = []
    order = torch.randperm(n, generator=gen)
    cursor = 0
    sae.train()
    for step in range(cfg.steps):
        if cursor + min(cfg.batch_size, n) > n:
            order, cursor = torch.randperm(n, generator=gen), 0
        idx = order[cursor : cursor + cfg.batch_size].to(device)
        cursor += len(idx)
        coeff = cfg.l1_coeff * min(1.0, (step + 1) / warmup)
        with cfg.precision(device):
            loss = gated_sae_loss(sae, data[idx], coeff)
        optimizer.zero_grad(set_to_none=True)
        loss.total.backward()
        remove_parallel_decoder_grad_(sae)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(sae.parameters(), cfg.grad_clip)
        optimizer.step()
        normalize_decoder_(sae)
        value = float(loss.total.detach())
        if on_step is not None:
            on_step(value)
        if step % max(1, cfg.steps // 20) == 0 or step == cfg.steps - 1:
            history.append(
                {
                    "step": step,
                    "loss": value,
                    "reconstruction": float(loss.reconstruction.detach()),
                    "sparsity": float(loss.sparsity.detach()),
                    "auxiliary": float(loss.auxiliary.detach()),
                }
            )
    return freeze(sae), history
