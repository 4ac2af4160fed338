"""Gated sparse autoencoders on a model's last-layer MLP outputs (the feature space of sae_fd)."""

from forgetless.sae.gated import (
    GatedCodes,
    GatedLoss,
    GatedSAE,
    GatedSAEConfig,
    decode,
    encode,
    gated_sae_loss,
    load_sae,
    magnitude_weights,
    reconstruct,
    save_sae,
)
from forgetless.sae.train import SAEMetrics, SAETrainConfig, sae_metrics, train_sae

__all__ = [
    "GatedCodes",
    "GatedLoss",
    "GatedSAE",
    "GatedSAEConfig",
    "SAEMetrics",
    "SAETrainConfig",
    "decode",
    "encode",
    "gated_sae_loss",
    "load_sae",
    "magnitude_weights",
    "reconstruct",
    "sae_metrics",
    "save_sae",
    "train_sae",
]
