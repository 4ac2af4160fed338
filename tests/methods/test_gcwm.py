"""GCWM (experimental): barycenter, conflict, gate and correction against closed forms and dense."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from forgetless.experimental import ExperimentalWarning
    from forgetless.experimental.gcwm import (
        GCWMParams,
        bw_barycenter,
        consensus,
        gate_value,
        gcwm_layer,
        gcwm_layer_dense,
        psd_power,
        truncate,
    )
from forgetless.diagnostics.geometry import DTYPE, LowRank


def _updates(m: int, d: int, r: int, n: int) -> list[LowRank]:
    return [
        LowRank(torch.randn(m, r, dtype=DTYPE), torch.randn(r, d, dtype=DTYPE)) for _ in range(n)
    ]


def test_importing_experimental_warns() -> None:
    import forgetless.experimental as exp

    with pytest.warns(UserWarning, match="experimental") as record:
        importlib.reload(exp)
    assert record[0].category.__name__ == ExperimentalWarning.__name__


def test_barycenter_of_one_geometry_is_itself() -> None:
    a = torch.randn(6, 3, dtype=DTYPE)
    s, _ = bw_barycenter([a], [1.0])
    assert torch.allclose(s, a @ a.T, atol=1e-10)


def test_barycenter_of_diagonal_geometries_has_the_closed_form() -> None:
    diags = [torch.rand(5, dtype=DTYPE) + 0.1 for _ in range(3)]
    weights = [0.2, 0.3, 0.5]
    s, iters = bw_barycenter([torch.diag(c.sqrt()) for c in diags], weights, 200, 1e-13)
    expected = sum(w * c.sqrt() for w, c in zip(weights, diags, strict=True)) ** 2
    assert iters < 200
    assert torch.allclose(s, torch.diag(expected), atol=1e-10)


def test_barycenter_solves_the_fixed_point_equation() -> None:
    factors = [torch.randn(4, 4, dtype=DTYPE) for _ in range(3)]
    weights = [0.5, 0.25, 0.25]
    s, _ = bw_barycenter(factors, weights, 500, 1e-14)
    root = psd_power(s, 0.5)
    rhs = sum(
        w * psd_power(root @ f @ f.T @ root, 0.5) for w, f in zip(weights, factors, strict=True)
    )
    assert torch.allclose(s, rhs, atol=1e-9)


OPTIONS = {
    "barycenter": GCWMParams(max_iter=500, tol=1e-13),
    "mean": GCWMParams(metric="mean"),
    "no_cancellation": GCWMParams(conflict_cancellation=False, max_iter=500, tol=1e-13),
    "amplify_sigmoid_tn": GCWMParams(
        gate_direction="amplify",
        gate_shape="sigmoid",
        conflict_trace_normalized=True,
        max_iter=500,
        tol=1e-13,
    ),
}


@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_low_rank_gcwm_matches_the_dense_reference(case: str) -> None:
    updates = _updates(10, 16, 2, 3)
    weights = [1.0, 0.5, 2.0]
    layer = gcwm_layer(updates, weights, OPTIONS[case])
    dense, kappa = gcwm_layer_dense([u.dense() for u in updates], weights, OPTIONS[case])
    assert layer.conflict == pytest.approx(kappa, abs=1e-6)
    scale = float(dense.abs().max())
    assert scale > 0
    assert float((layer.correction.dense() - dense).abs().max()) < 1e-5 * scale


def test_one_task_merges_to_itself() -> None:
    (update,) = _updates(8, 12, 3, 1)
    opts = GCWMParams(conflict_cancellation=False, consensus_ridge=0.0)
    layer = gcwm_layer([update], [1.0], opts)
    assert layer.conflict == pytest.approx(0.0, abs=1e-9)
    assert float(layer.correction.dense().abs().max()) < 1e-9


def test_weight_zero_gives_no_correction() -> None:
    layer = gcwm_layer(_updates(8, 12, 3, 2), [0.0, 0.0], GCWMParams())
    assert float(layer.correction.dense().abs().max()) == 0.0


def test_conflict_is_zero_for_equal_geometries_and_positive_otherwise() -> None:
    (update,) = _updates(8, 12, 3, 1)
    same = gcwm_layer([update, update], [1.0, 1.0], GCWMParams())
    assert same.conflict == pytest.approx(0.0, abs=1e-8)
    assert same.gate == pytest.approx(1.0, abs=1e-8)  # hold_back, linear: nothing held back
    apart = gcwm_layer(_updates(8, 12, 3, 2), [1.0, 1.0], GCWMParams())
    assert 0.05 < apart.conflict <= 1.0 and apart.gate == pytest.approx(1 - apart.conflict)


def test_gate_direction_shape_and_ablation() -> None:
    hold, amp = GCWMParams(), GCWMParams(gate_direction="amplify")
    assert gate_value(0.1, hold) > gate_value(0.8, hold)  # the paper: conflict holds back
    assert gate_value(0.1, amp) < gate_value(0.8, amp)  # the public code: the other way
    step = GCWMParams(gate_shape="step", threshold=0.3, strength=0.5)
    assert (gate_value(0.2, step), gate_value(0.4, step)) == (0.5, 0.0)
    sig = GCWMParams(gate_shape="sigmoid", threshold=0.3)
    assert gate_value(0.3, sig) == pytest.approx(0.5)
    flat = GCWMParams(conflict_cancellation=False, strength=0.7)
    assert gate_value(0.0, flat) == gate_value(1.0, flat) == 0.7


def test_consensus_is_the_least_squares_minimizer() -> None:
    taus = [
        torch.randn(5, 6, dtype=DTYPE) @ torch.diag(torch.rand(6, dtype=DTYPE)) for _ in range(3)
    ]
    weights = [1.0, 2.0, 0.5]
    best = consensus(taus, weights, ridge=0.0).requires_grad_(True)
    loss = sum(
        w * ((best - t) @ t.T).pow(2).sum() / t.pow(2).sum()
        for w, t in zip(weights, taus, strict=True)
    )
    assert isinstance(loss, torch.Tensor)
    (grad,) = torch.autograd.grad(loss, best)
    assert float(grad.abs().max()) < 1e-8


def test_wide_layers_never_form_a_d_by_d_matrix() -> None:
    # d = 60k: a float64 d × d matrix would need ~29 GB; the factored path needs a few MB.
    updates = _updates(16, 60_000, 2, 2)
    layer = gcwm_layer(updates, [1.0, 1.0], GCWMParams())
    assert layer.correction.right.shape == (4, 60_000)
    assert torch.isfinite(layer.correction.left).all()


def test_truncate_keeps_the_best_rank_k_part() -> None:
    delta = torch.randn(9, 3, dtype=DTYPE) @ torch.randn(3, 7, dtype=DTYPE)
    exact, energy = truncate(delta, 5)
    assert energy == pytest.approx(1.0) and torch.allclose(exact.dense(), delta, atol=1e-10)
    approx, energy = truncate(delta, 1)
    assert 0 < energy < 1 and approx.left.shape == (9, 1)
