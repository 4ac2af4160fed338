"""The first-token control of the real SAE's metrics (studies/real_sae_sink.py)."""

from __future__ import annotations

import pytest
import real_sae_sink
import torch


def test_the_first_tokens_share_of_variance_is_what_their_position_alone_explains() -> None:
    gen = torch.Generator().manual_seed(0)
    rest = torch.randn(90, 8, generator=gen)
    sink = torch.full((10, 8), 30.0)  # the same large vector at every example's first token
    acts = torch.cat([sink, rest])
    first = torch.arange(100) < 10
    explained = real_sae_sink.explained_by_position(acts, first)
    total = (acts - acts.mean(0)).pow(2).sum()
    within_rest = (rest - rest.mean(0)).pow(2).sum()
    assert explained == pytest.approx(float(1 - within_rest / total), rel=1e-6)
    assert explained > 0.9
    norms = real_sae_sink.norms(acts, first)
    assert norms["first_share_of_tokens"] == pytest.approx(0.1)
    assert norms["first_mean_norm"] == pytest.approx(30.0 * 8**0.5)
    assert norms["first_share_of_squares"] > 0.9
