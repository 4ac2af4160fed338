"""A gated sparse autoencoder (SAE): one small module and pure typed functions over it.

Rajamanoharan et al. 2024, "Improving Dictionary Learning with Gated Sparse Autoencoders"
(arXiv 2404.16014). With ``u = h / s`` the scaled input (``s`` a fixed input scale, see below)
and ``x = u − b_dec`` what the encoders read:

- gate path:      ``π_gate = W_gate x + b_gate``, ``f_gate = 1[π_gate > 0]``
- magnitude path: ``π_mag = W_mag x + b_mag``, ``W_mag = exp(r_mag) ⊙ W_gate`` (row-wise)
- features:       ``f = f_gate ⊙ ReLU(π_mag)``
- decoder:        ``x̂ = W_dec f + b_dec`` (columns of ``W_dec`` at unit norm)
- loss:           ``‖u − x̂‖² + λ_sparse ‖ReLU(π_gate)‖₁ + ‖u − x̂_frozen(ReLU(π_gate))‖²``

The two paths share their encoder directions (the rows of ``W_gate``); the magnitude path only
rescales each row by ``exp(r_mag)`` and has its own bias. The sparsity penalty is the paper's, on
the gate path's ``ReLU(π_gate)``: the Heaviside gate passes no gradient, so an L1 on the gated
``f`` (the simplified ``λ‖f‖₁`` of some summaries) would give the gate no sparsity pressure. The
auxiliary term reconstructs from ``ReLU(π_gate)`` through a frozen (stop-gradient) copy of the
decoder, which is what trains the gate path's directions and bias.

Choices of ours, not the paper's statement: the input scale ``s`` is fixed once from the
training activations so that ``E‖h / s‖² = 1`` (one ``λ_sparse`` then suits any model width and
activation scale), and training starts from ``b_dec`` at the mean of the scaled data and short
encoder rows parallel to the decoder columns (``init_for_training_``). The decoder columns are
kept at unit norm as in the paper (its gradient's radial part removed before each step, the
columns renormalised after it), not folded into the L1 as in SAELens: with the paper's frozen
decoder in the auxiliary term that form let the decoder norms shrink and the code go dense (one
of the paper's authors warns to freeze the decoder in both places or in neither).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from forgetless.core.fields import Count, Positive
from forgetless.core.modules import freeze

WEIGHTS_FILE = "sae.safetensors"
CONFIG_FILE = "sae_config.json"


class GatedSAEConfig(BaseModel):
    """The shape of a gated SAE and the fixed scale its inputs are divided by."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    d_in: Count
    """Width d of the activations it encodes."""
    d_sae: Count
    """Number of features D (D ≫ d: overcomplete)."""
    input_scale: Positive = 1.0
    """Activations are divided by this first."""


class GatedSAE(nn.Module):
    """The parameters of a gated SAE; the maths is in the module-level functions below."""

    def __init__(self, cfg: GatedSAEConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)
        w_dec = torch.randn(cfg.d_in, cfg.d_sae, generator=gen)
        w_dec = w_dec / w_dec.norm(dim=0, keepdim=True)
        self.W_dec = nn.Parameter(w_dec)
        self.b_dec = nn.Parameter(torch.zeros(cfg.d_in))
        self.W_gate = nn.Parameter(w_dec.T.clone())  # tied initialisation: encoder = decoderᵀ
        self.b_gate = nn.Parameter(torch.zeros(cfg.d_sae))
        self.r_mag = nn.Parameter(torch.zeros(cfg.d_sae))
        self.b_mag = nn.Parameter(torch.zeros(cfg.d_sae))

    @property
    def d_in(self) -> int:
        return self.cfg.d_in

    @property
    def d_sae(self) -> int:
        return self.cfg.d_sae


class GatedCodes(NamedTuple):
    """One encoding: both pre-activations and the gated post-ReLU features ``f``."""

    pi_gate: Tensor
    pi_mag: Tensor
    f: Tensor


class GatedLoss(NamedTuple):
    total: Tensor
    reconstruction: Tensor
    sparsity: Tensor
    auxiliary: Tensor


# --- the maths ---------------------------------------------------------------------------------


def magnitude_weights(w_gate: Tensor, r_mag: Tensor) -> Tensor:
    """``W_mag = exp(r_mag) ⊙ W_gate``: each feature's gate direction, rescaled per feature."""
    return torch.exp(r_mag).unsqueeze(-1) * w_gate


def centred_input(sae: GatedSAE, h: Tensor) -> Tensor:
    """``h / s − b_dec``: what both encoder paths read."""
    return h.float() / sae.cfg.input_scale - sae.b_dec


def encode(sae: GatedSAE, h: Tensor) -> GatedCodes:
    """Encode activations ``h`` (``(..., d)``) into both pre-activations and the features."""
    x = centred_input(sae, h)
    projection = x @ sae.W_gate.T  # the shared directions, computed once for both paths
    pi_gate = projection + sae.b_gate
    pi_mag = projection * torch.exp(sae.r_mag) + sae.b_mag
    f = (pi_gate > 0).to(pi_mag.dtype) * torch.relu(pi_mag)
    return GatedCodes(pi_gate, pi_mag, f)


def decode(sae: GatedSAE, f: Tensor) -> Tensor:
    """``x̂ = W_dec f + b_dec``, in the SAE's scaled input space."""
    return f @ sae.W_dec.T + sae.b_dec


def reconstruct(sae: GatedSAE, h: Tensor) -> Tensor:
    """The reconstruction of ``h`` in its own units (the input scale undone)."""
    return decode(sae, encode(sae, h).f) * sae.cfg.input_scale


def gated_sae_loss(sae: GatedSAE, h: Tensor, l1_coeff: float) -> GatedLoss:
    """The gated SAE paper's loss, each part a mean over the rows of ``h``.

    ``reconstruction`` trains the magnitude path, decoder and ``b_dec``; ``sparsity`` is the L1 of
    ``ReLU(π_gate)``; ``auxiliary`` reconstructs from ``ReLU(π_gate)`` through a stop-gradient
    copy of ``W_dec`` and ``b_dec``, so it trains only the gate path.
    """
    x_in = h.float() / sae.cfg.input_scale
    codes = encode(sae, h)
    reconstruction = (x_in - decode(sae, codes.f)).pow(2).sum(-1).mean()
    gate_act = torch.relu(codes.pi_gate)
    sparsity = gate_act.sum(-1).mean()
    frozen = gate_act @ sae.W_dec.detach().T + sae.b_dec.detach()
    auxiliary = (x_in - frozen).pow(2).sum(-1).mean()
    total = reconstruction + l1_coeff * sparsity + auxiliary
    return GatedLoss(total, reconstruction, sparsity, auxiliary)


@torch.no_grad()
def init_for_training_(sae: GatedSAE, data_mean: Tensor, encoder_norm: float) -> None:
    """The start of training, in place: ``W_gate = encoder_norm · W_decᵀ`` (unit-norm decoder
    columns), ``b_dec`` at the mean of the scaled data, ``b_gate = b_mag = r_mag = 0``.

    Encoder rows start parallel to their decoder columns (as in Conerly et al. 2024, Anthropic's
    April 2024 circuits update) but short. From unit-norm rows about half of the ``D ≫ d``
    features fire at full size at step 0 (zero gate biases): the code is dense and the
    reconstruction error many times the data's variance (13× on the synthetic data of issue 24,
    D = 8d), a start from which Adam recovered none of that data's dictionary. From short rows
    the code starts near zero and each feature grows as the reconstruction asks for it.
    """
    w_dec = sae.W_dec / sae.W_dec.norm(dim=0, keepdim=True).clamp_min(1e-8)
    sae.W_dec.copy_(w_dec)
    sae.W_gate.copy_(encoder_norm * w_dec.T)
    sae.b_dec.copy_(data_mean)
    for bias in (sae.b_gate, sae.b_mag, sae.r_mag):
        bias.zero_()


@torch.no_grad()
def remove_parallel_decoder_grad_(sae: GatedSAE) -> None:
    """Drop, in place, the part of each decoder column's gradient that is parallel to the column.

    The gated SAE paper keeps decoder columns at unit norm (after Bricken et al. 2023); the
    radial part of the gradient would only be undone by the renormalisation after the step, but
    it still feeds Adam's moment estimates and shrinks the step actually taken along the sphere.
    Call after ``backward()`` and before the optimizer step; the columns must be at unit norm.
    """
    grad = sae.W_dec.grad
    if grad is None:
        return
    grad.sub_(sae.W_dec * (sae.W_dec * grad).sum(dim=0, keepdim=True))


@torch.no_grad()
def normalize_decoder_(sae: GatedSAE) -> None:
    """Rescale every decoder column to unit norm (in place), so the L1 cannot be dodged by
    shrinking the gate pre-activations and growing the decoder."""
    sae.W_dec.div_(sae.W_dec.norm(dim=0, keepdim=True).clamp_min(1e-8))


# --- files -------------------------------------------------------------------------------------


def save_sae(sae: GatedSAE, folder: Path, extra: dict[str, Any] | None = None) -> None:
    """``sae.safetensors`` (weights) and ``sae_config.json`` (shape, scale and ``extra``)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in sae.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE))
    record = {"architecture": "gated", "sae": sae.cfg.model_dump(), **(extra or {})}
    (folder / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def read_sae_record(folder: Path) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    return record


def load_sae(folder: Path, device: torch.device | str = "cpu") -> GatedSAE:
    """A saved SAE, frozen, on ``device``."""
    if not (folder / WEIGHTS_FILE).is_file() or not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{folder}: no {WEIGHTS_FILE} with {CONFIG_FILE}")
    record = read_sae_record(folder)
    if record.get("architecture") != "gated":
        raise ValueError(f"{folder}: not a gated SAE ({record.get('architecture')!r})")
    sae = GatedSAE(GatedSAEConfig.model_validate(record["sae"]))
    sae.load_state_dict(load_file(str(folder / WEIGHTS_FILE)))
    return freeze(sae).to(device)
