"""Training a gated SAE on a table of activations, and the metrics it is judged by."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from forgetless.sae.gated import (
    GatedSAE,
    GatedSAEConfig,
    encode,
    freeze,
    gated_sae_loss,
    normalize_decoder_,
    reconstruct,
)


class SAETrainConfig(BaseModel):
    """How the gated SAE is built and trained (on the base model's last-layer MLP outputs)."""

    model_config = ConfigDict(extra="forbid")
    expansion: int = Field(8, ge=1, description="Features per activation dimension: D = e·d.")
    l1_coeff: float = Field(
        0.2,
        ge=0,
        description="λ_sparse on ‖ReLU(π_gate)‖₁, with activations scaled to E‖h‖² = 1. Chosen on "
        "the tiny base (0.15: EV 0.97 at L0 13; 0.3: EV 0.95 at L0 5, of D = 1024); tune per "
        "model.",
    )
    steps: int = Field(3000, ge=1, description="Adam steps.")
    batch_size: int = Field(1024, ge=1, description="Activation vectors (tokens) per step.")
    lr: float = Field(1e-3, gt=0, description="Adam learning rate (constant after warm-up).")
    l1_warmup: float = Field(
        0.05, ge=0, le=1, description="Share of the steps over which λ_sparse ramps up from 0."
    )
    n_per_task: int = Field(
        300, ge=1, description="Examples per data source for the activations (train split)."
    )
    tasks: list[str | dict[str, Any]] | None = Field(
        None,
        description="Data sources: built-in task names, or task entries as in a run config "
        "(jsonl / hf); null = every built-in task.",
    )
    seed: int = Field(0, description="Seed of the SAE's initialisation, data and batch order.")

    def width(self, d_in: int) -> int:
        return self.expansion * d_in


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

    Adam on the gated SAE loss; λ_sparse ramps linearly over the first ``l1_warmup`` share of the
    steps; decoder columns are put back at unit norm after each step. Deterministic under
    ``cfg.seed`` on one device. Returns the frozen SAE and a short loss history.
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
    with torch.no_grad():
        sae.b_dec.copy_(data.mean(0) / scale)
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
        loss = gated_sae_loss(sae, data[idx], coeff)
        optimizer.zero_grad(set_to_none=True)
        loss.total.backward()
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
