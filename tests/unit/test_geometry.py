"""Bures–Wasserstein geometry conflict: low-rank vs dense, edge cases, and `diagnose geometry`."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console

from forgetless.cli.app import main
from forgetless.config.loading import validate_config
from forgetless.diagnostics.diagnose_geometry import (
    fisher_interval,
    loglik_changes,
    pearson,
    position_residuals,
    retention_changes,
    run_level,
    spearman,
)
from forgetless.diagnostics.geometry import (
    Geometry,
    bures_wasserstein_sq,
    bures_wasserstein_sq_dense,
    geometry_from_dense,
    geometry_from_lowrank,
    lora_update,
    normalized_bw_sq,
    pairwise_conflict,
    subspace_alignment,
    trace_normalized,
)
from forgetless.training.runner import Runner

D = 64


def random_factor(d: int, rank: int, seed: int, deficient: int = 0) -> torch.Tensor:
    """A ``d × rank`` factor whose last ``deficient`` columns repeat earlier ones."""
    gen = torch.Generator().manual_seed(seed)
    factor = torch.randn(d, rank, generator=gen, dtype=torch.float64)
    for k in range(deficient):
        factor[:, rank - 1 - k] = 0.5 * factor[:, k]
    return factor


def test_identical_inputs_give_zero() -> None:
    g = Geometry(random_factor(D, 6, 1))
    assert bures_wasserstein_sq(g, g) == pytest.approx(0.0, abs=1e-8 * g.trace)
    same = Geometry(g.factor @ torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))[0])
    assert bures_wasserstein_sq(g, same) == pytest.approx(0.0, abs=1e-8 * g.trace)


def test_symmetric() -> None:
    a, b = Geometry(random_factor(D, 4, 2)), Geometry(random_factor(D, 8, 3))
    assert bures_wasserstein_sq(a, b) == pytest.approx(bures_wasserstein_sq(b, a), rel=1e-10)


def test_commuting_diagonal_closed_form() -> None:
    x = torch.tensor([4.0, 1.0, 0.0, 9.0], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 2.0, 9.0], dtype=torch.float64)
    expected = float(((x.sqrt() - y.sqrt()) ** 2).sum())
    a, b = Geometry(torch.diag(x.sqrt())), Geometry(torch.diag(y.sqrt()))
    assert bures_wasserstein_sq(a, b) == pytest.approx(expected, rel=1e-10)
    assert bures_wasserstein_sq_dense(torch.diag(x), torch.diag(y)) == pytest.approx(expected)


def test_scalar_case() -> None:
    a, b = (
        Geometry(torch.tensor([[3.0]], dtype=torch.float64)),
        Geometry(torch.tensor([[5.0]], dtype=torch.float64)),
    )
    assert bures_wasserstein_sq(a, b) == pytest.approx((3.0 - 5.0) ** 2)


@pytest.mark.parametrize(
    ("rank_a", "rank_b", "deficient"), [(4, 4, 0), (4, 8, 0), (8, 6, 0), (6, 8, 2), (8, 8, 3)]
)
def test_lowrank_matches_dense(rank_a: int, rank_b: int, deficient: int) -> None:
    fa = random_factor(D, rank_a, 10 + rank_a, deficient)
    fb = random_factor(D, rank_b, 20 + rank_b, deficient)
    a, b = Geometry(fa), Geometry(fb)
    dense = bures_wasserstein_sq_dense(fa @ fa.T, fb @ fb.T)
    assert bures_wasserstein_sq(a, b) == pytest.approx(dense, rel=1e-6, abs=1e-6)


def test_geometry_from_updates_matches_dense() -> None:
    gen = torch.Generator().manual_seed(5)
    lora_a = torch.randn(4, D, generator=gen)
    lora_b = torch.randn(48, 4, generator=gen)
    update = lora_update(lora_a, lora_b, scale=2.0)
    delta = update.dense()
    exact = geometry_from_lowrank(update)
    torch.testing.assert_close(exact.dense(), delta.T @ delta)
    svd = geometry_from_dense(delta, rank=4)
    assert svd.energy == pytest.approx(1.0)
    torch.testing.assert_close(svd.dense(), delta.T @ delta)
    truncated = geometry_from_dense(torch.randn(48, D, dtype=torch.float64), rank=4)
    assert 0.0 < truncated.energy < 1.0


def test_zero_matrices_no_nan() -> None:
    zero = Geometry(torch.zeros(D, 4, dtype=torch.float64))
    other = Geometry(random_factor(D, 4, 7))
    for a, b in [(zero, zero), (zero, other), (other, zero)]:
        for value in (
            bures_wasserstein_sq(a, b),
            normalized_bw_sq(a, b),
            pairwise_conflict(a, b, normalize_trace=True),
        ):
            assert math.isfinite(value)
    assert normalized_bw_sq(zero, zero) == 0.0
    assert normalized_bw_sq(zero, other) == pytest.approx(1.0)
    assert bures_wasserstein_sq_dense(torch.zeros(D, D), torch.zeros(D, D)) == 0.0


def test_normalized_in_unit_interval() -> None:
    for seed in range(10):
        a = Geometry(random_factor(D, 4 + seed % 5, seed, deficient=seed % 3))
        b = Geometry(random_factor(D, 8, 100 + seed) * (seed + 1))
        value = normalized_bw_sq(a, b)
        assert 0.0 <= value <= 1.0
        tn = trace_normalized(a)
        assert tn.trace == pytest.approx(1.0)


def test_stats_helpers() -> None:
    assert retention_changes([[0.0, 0.0], [0.5, 0.1], [0.3, 0.9]]) == [None, pytest.approx(-0.2)]
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert pearson(x, [2 * v for v in x]) == pytest.approx(1.0)
    assert spearman(x, [v**3 for v in x]) == pytest.approx(1.0)
    interval = fisher_interval(0.5, 20)
    assert interval is not None and interval[0] < 0.5 < interval[1]
    assert pearson([1.0, 2.0], [1.0, 2.0]) is None


def test_loglik_change_counts_only_tasks_still_retained() -> None:
    matrix = [[0.0, 0.0, 0.0], [0.8, 0.0, 0.0], [0.0, 0.9, 0.0], [0.0, 0.5, 0.7]]
    loglik = [[-5.0, -5.0, -5.0], [-1.0, -4.0, -5.0], [-3.0, -0.5, -5.0], [-6.0, -2.0, -0.4]]
    # task 2 moves task 1 (retained at 0.8) by −2; task 3 moves only task 2 (task 1 sits at 0)
    assert loglik_changes(loglik, matrix) == [None, pytest.approx(-2.0), pytest.approx(-1.5)]


def test_subspace_alignment_is_the_share_inside_the_states_top_directions() -> None:
    state = Geometry(torch.eye(D, dtype=torch.float64)[:, :3] * torch.tensor([3.0, 2.0, 1.0]))
    second = Geometry(torch.eye(D, dtype=torch.float64)[:, 1:2])
    outside = Geometry(torch.eye(D, dtype=torch.float64)[:, 10:11])
    assert subspace_alignment(second, state) == pytest.approx(0.0)  # k = 1: only the top one
    top = Geometry(torch.eye(D, dtype=torch.float64)[:, :1] * 5.0)
    assert subspace_alignment(top, state) == pytest.approx(1.0)
    assert subspace_alignment(outside, state) == pytest.approx(0.0)
    half = Geometry(
        torch.eye(D, dtype=torch.float64)[:, :1] + torch.eye(D, dtype=torch.float64)[:, 10:11]
    )
    assert subspace_alignment(half, state) == pytest.approx(0.5)


def test_run_level_takes_one_correlation_per_run() -> None:
    rows = [
        {"run": run, "sar": float(i), "retention_change_loglik": sign * float(i)}
        for run, sign in (("a", 1.0), ("b", 1.0), ("c", -1.0))
        for i in range(5)
    ]
    found = run_level(rows, "retention_change_loglik")["sar"]
    assert found["runs"] == 3
    assert found["spearman"]["mean"] == pytest.approx(1 / 3)
    assert run_level(rows[:3], "retention_change_loglik")["sar"]["runs"] == 0  # too few points


def test_position_control_removes_a_pure_position_effect_and_keeps_a_task_one() -> None:
    """Update norm shrinks and ΔR rises with position in every order: a perfect pooled and
    within-run correlation that is position alone. Once each position's mean is taken out, only
    what differs between runs at the same position is left."""
    rows = [
        {
            "run": f"o{order}",
            "task_index": t,
            "update_norm": 10.0 - t,
            "retention_change_loglik": float(t),
        }
        for order in range(3)
        for t in range(1, 8)
    ]
    assert run_level(rows, "retention_change_loglik")["update_norm"]["spearman"]["mean"] == -1.0
    controlled = run_level(
        position_residuals(rows, "retention_change_loglik"), "retention_change_loglik"
    )
    assert controlled["update_norm"]["runs"] == 0  # nothing left to correlate
    noise = [0.3, -0.1, 0.7, -0.4, 0.2, 0.5, -0.6]
    for row in rows:  # a task effect: a larger update than its position's loses more
        bump = noise[(row["task_index"] + 2 * int(row["run"][1])) % 7]
        row["update_norm"] += bump
        row["retention_change_loglik"] -= bump
    controlled = run_level(
        position_residuals(rows, "retention_change_loglik"), "retention_change_loglik"
    )["update_norm"]
    assert controlled["runs"] == 3 and controlled["spearman"]["mean"] < -0.95  # rounding ties
    assert set(controlled["per_run"]) == {"o0", "o1", "o2"}


@pytest.mark.parametrize(
    "finetune", [{"mode": "full"}, {"mode": "lora", "lora": {"regime": "carry", "r": 2}}]
)
def test_diagnose_geometry_end_to_end(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    finetune: dict[str, Any],
) -> None:
    cfg = validate_config(
        tiny_run_config(tiny_model_dir, tasks=["reverse", "cipher", "bracket"], finetune=finetune)
    )
    run_dir = tmp_path / "run"
    Runner(cfg, run_dir, Console(quiet=True), progress=False).run()
    monkeypatch.setattr(sys, "argv", ["forgetless", "diagnose", "geometry", str(run_dir)])
    try:
        main()
    except SystemExit as exit_info:
        assert not exit_info.code
    data = json.loads((run_dir / "geometry.json").read_text())
    rows = data["rows"]
    assert [r["task"] for r in rows] == ["reverse", "cipher", "bracket"]
    assert rows[0]["retention_change"] is None and rows[0]["state_conflict"] is None
    for row in rows:
        assert row["update_norm"] > 0 and row["layers"] > 0
    for row in rows[1:]:
        for key in ("state_conflict", "state_conflict_tn", "pairwise_conflict"):
            assert 0.0 <= row[key] <= 1.0
        assert row["retention_change"] is not None
    assert set(data["correlations"]) >= {"update_norm", "state_conflict", "pairwise_conflict"}
    assert "sar" in data["correlations_loglik"] and "sar" in data["run_level"]
    within = data["within_run"]
    assert within["target"] == "retention_change_loglik"
    assert set(within["signals"]) == set(data["run_level"])
    assert set(within["state_conflict_minus"]) == {"update_norm", "pairwise_conflict", "sar"}
    assert all(0.0 <= row["sar"] <= 1.0 + 1e-9 for row in rows[1:])
    assert (run_dir / "geometry.png").is_file()
    assert not list(run_dir.glob(".geometry*"))
