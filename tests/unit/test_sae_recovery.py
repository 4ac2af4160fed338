"""The gated SAE recovers a known dictionary (issue 24).

Data of the kind the issue measured on, smaller: each vector the sum of a few of many random
unit directions (magnitudes in [0.5, 1.5]) plus a little noise, scaled to E‖x‖² = 1. With the
default training settings (only the size of the run shrunk) the SAE must find ≥ 90% of the
directions (some decoder column at cosine > 0.9) with about the true number of features firing
per vector. The full-size problem, side by side with SAELens, is ``benchmarks/sae_recovery.py``.
"""

from __future__ import annotations

import torch

from forgetless.sae import sae_metrics
from forgetless.sae.train import (
    SAETrainConfig,
    direction_recovery,
    sparse_synthetic_data,
    train_sae,
)

D_IN, DIRECTIONS, ACTIVE = 64, 256, 4  # as sparse as the 8 of 1024 in d = 128


def test_recovers_the_ground_truth_directions_at_the_true_l0() -> None:
    data, directions = sparse_synthetic_data(24_000, D_IN, DIRECTIONS, ACTIVE, seed=0)
    train, held_out = data[:20_000], data[20_000:]
    cfg = SAETrainConfig(expansion=DIRECTIONS // D_IN, steps=4000, batch_size=256, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the budget it is sized for: ~11 s on one thread
    try:
        sae, history = train_sae(train, cfg)
    finally:
        torch.set_num_threads(threads)
    best = direction_recovery(sae.W_dec, directions)
    recovered = int((best > 0.9).sum())
    metrics = sae_metrics(sae, held_out)
    assert recovered >= 0.9 * DIRECTIONS, (recovered, metrics)
    assert ACTIVE / 1.5 <= metrics.l0 <= ACTIVE * 1.5, metrics
    assert metrics.explained_variance > 0.8, metrics
    assert history[-1]["loss"] < history[0]["loss"]


def test_synthetic_data_has_the_stated_shape_and_scale() -> None:
    x, directions = sparse_synthetic_data(2000, 16, 40, 3, noise=0.0, seed=1)
    assert x.shape == (2000, 16) and directions.shape == (40, 16)
    torch.testing.assert_close(directions.norm(dim=1), torch.ones(40))
    assert abs(float(x.pow(2).sum(-1).mean()) - 1.0) < 1e-4
    again, same_dirs = sparse_synthetic_data(2000, 16, 40, 3, noise=0.0, seed=1)
    torch.testing.assert_close(again, x)
    torch.testing.assert_close(same_dirs, directions)
    best = direction_recovery(directions.T * 3.0, directions)
    torch.testing.assert_close(best, torch.ones(40))
