"""Tests for forgetless.eval.metrics: hand-computed values on small accuracy matrices."""

from __future__ import annotations

import math

import pytest
import torch

from forgetless.eval.metrics import (
    RUN_METRICS,
    average_accuracy,
    average_forgetting,
    backward_transfer,
    forward_transfer,
    plasticity_gain,
    probe_retention,
    probe_retention_detail,
    probe_retention_unclipped,
    summarize,
    token_kl,
)

# Row 0 = base model, row i = after training task i; column j-1 = task j.
R3 = [
    [0.20, 0.10, 0.30],  # base
    [0.80, 0.30, 0.40],  # after task 1
    [0.85, 0.90, 0.50],  # after task 2 (task 1 peaks here, after it was trained)
    [0.50, 0.70, 0.90],  # after task 3
]
R1 = [[0.1], [0.7]]


def test_average_accuracy() -> None:
    assert average_accuracy(R3) == pytest.approx((0.5 + 0.7 + 0.9) / 3)
    assert average_accuracy(R1) == pytest.approx(0.7)


def test_backward_transfer() -> None:
    # (R[3,1] - R[1,1]) and (R[3,2] - R[2,2])
    expected = ((0.50 - 0.80) + (0.70 - 0.90)) / 2
    assert backward_transfer(R3) == pytest.approx(expected)
    assert expected < 0  # negative BWT = forgetting


def test_backward_transfer_positive() -> None:
    R = [[0.0, 0.0], [0.4, 0.0], [0.6, 0.8]]
    assert backward_transfer(R) == pytest.approx(0.6 - 0.4)


def test_forward_transfer() -> None:
    # (R[1,2] - R[0,2]) and (R[2,3] - R[0,3])
    expected = ((0.30 - 0.10) + (0.50 - 0.30)) / 2
    assert forward_transfer(R3) == pytest.approx(expected)


def test_plasticity_gain() -> None:
    expected = ((0.80 - 0.20) + (0.90 - 0.10) + (0.90 - 0.30)) / 3
    assert plasticity_gain(R3) == pytest.approx(expected)
    assert plasticity_gain(R1) == pytest.approx(0.7 - 0.1)


def test_average_forgetting() -> None:
    # task 1: max(R[1,1], R[2,1]) - R[3,1] = 0.85 - 0.50; task 2: R[2,2] - R[3,2] = 0.90 - 0.70
    expected = ((0.85 - 0.50) + (0.90 - 0.70)) / 2
    assert average_forgetting(R3) == pytest.approx(expected)
    # Differs from -BWT because task 1 peaked after it was trained.
    bwt = backward_transfer(R3)
    assert bwt is not None
    assert average_forgetting(R3) != pytest.approx(-bwt)


def test_average_forgetting_ignores_base_row() -> None:
    # A high base accuracy on task 1 is not a "peak" to forget from: row 0 is left out.
    R = [[0.99, 0.0], [0.50, 0.0], [0.40, 0.6]]
    assert average_forgetting(R) == pytest.approx(0.50 - 0.40)
    assert average_forgetting(R, since="learned") == pytest.approx(0.50 - 0.40)


# The docstring's worked example: task 2 peaks zero-shot, after task 1, before it is trained.
R_PEAK_BEFORE = [
    [0.0, 0.0, 0.0],
    [0.9, 0.6, 0.0],
    [0.5, 0.4, 0.1],
    [0.2, 0.1, 0.8],
]


def test_average_forgetting_takes_every_earlier_row_as_chaudhry() -> None:
    # Chaudhry et al. 2018: max over l = 1..T-1. Task 1: 0.9 - 0.2; task 2: 0.6 - 0.1.
    assert average_forgetting(R_PEAK_BEFORE) == pytest.approx((0.7 + 0.5) / 2)
    # The rows-from-j-on variant (the old default) takes 0.4 - 0.1 for task 2.
    assert average_forgetting(R_PEAK_BEFORE, since="learned") == pytest.approx((0.7 + 0.3) / 2)


def test_average_forgetting_refuses_an_unknown_reference() -> None:
    with pytest.raises(ValueError, match="since"):
        average_forgetting(R3, since="best")  # type: ignore[arg-type]


def test_retention_is_bounded_per_probe() -> None:
    # Three skills gone and one that improved from a near-zero base: the old mean of ratios gave
    # (0 + 0 + 0 + 4) / 4 = 1.0; clipped per probe it is (0 + 0 + 0 + 1) / 4.
    assert probe_retention([1, 1, 1, 0.08], [0, 0, 0, 0.32]) == pytest.approx(0.25)
    assert probe_retention([0.5], [0.9]) == pytest.approx(1.0)
    assert probe_retention([0.5], [0.0]) == pytest.approx(0.0)


def test_retention_measures_from_chance() -> None:
    # A 4-choice probe: at chance (0.25) nothing is retained, half way back is 0.5.
    assert probe_retention([0.85], [0.25], chance=[0.25]) == pytest.approx(0.0)
    assert probe_retention([0.85], [0.10], chance=[0.25]) == pytest.approx(0.0)
    assert probe_retention([0.85], [0.55], chance=[0.25]) == pytest.approx(0.5)
    # Without the chance level the same probe would read 0.55 / 0.85.
    assert probe_retention([0.85], [0.55]) == pytest.approx(0.55 / 0.85)


def test_unclipped_retention_tells_apart_models_the_clip_ties() -> None:
    """Two models above the base both clip to 1; unclipped they differ (issue 49's case: gk-mc,
    base 181 of 320 questions, one model 185 and another 205)."""
    base, chance = [181 / 320], [0.25]
    one, other = [185 / 320], [205 / 320]
    assert probe_retention(base, one, chance) == probe_retention(base, other, chance) == 1.0
    low = probe_retention_unclipped(base, one, chance)
    high = probe_retention_unclipped(base, other, chance)
    assert low is not None and high is not None and 1.0 < low < high
    assert high == pytest.approx((205 / 320 - 0.25) / (181 / 320 - 0.25))
    detail = probe_retention_detail(["mc", "gen"], [0.5, 0.2], [0.7, 0.1], chance=[0.25, 0.25])
    assert [d.ratio for d in detail] == [pytest.approx(1.8), None]
    assert summarize([[0.0], [1.0]], base, other, chance)["retention_unclipped"] == high


def test_retention_reports_probes_at_chance_instead_of_dropping_them() -> None:
    detail = probe_retention_detail(["copy", "mc"], [0.9, 0.2], [0.45, 0.6], chance=[0.0, 0.25])
    assert [d.retention for d in detail] == [pytest.approx(0.5), None]
    assert [d.drop for d in detail] == [pytest.approx(0.45), pytest.approx(-0.4)]
    assert probe_retention([0.9, 0.2], [0.45, 0.6], chance=[0.0, 0.25]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one name, base, current and chance"):
        probe_retention_detail(["a"], [0.5, 0.5], [0.5, 0.5])


def test_average_forgetting_negative_when_final_is_best() -> None:
    R = [[0.0, 0.0], [0.5, 0.0], [0.9, 0.6]]
    assert average_forgetting(R) == pytest.approx(0.5 - 0.9)


def test_single_task_edge_cases() -> None:
    assert backward_transfer(R1) is None
    assert forward_transfer(R1) is None
    assert average_forgetting(R1) is None


@pytest.mark.parametrize(
    "bad",
    [
        [],  # no rows
        [[0.1]],  # only the base row
        [[0.1, 0.2], [0.3], [0.4, 0.5]],  # ragged
        [[0.1, 0.2, 0.3]] * 3,  # square: missing base row or extra column
        [[0.1], [0.2], [0.3]],  # T + 1 = 3 rows but 1 column
    ],
)
def test_shape_errors(bad: list[list[float]]) -> None:
    for fn in (
        average_accuracy,
        backward_transfer,
        forward_transfer,
        plasticity_gain,
        average_forgetting,
    ):
        with pytest.raises(ValueError, match="accuracy matrix"):
            fn(bad)


def test_probe_retention() -> None:
    # probe 2 has base 0 (at chance) and is left out: mean(0.25/0.5, 0.8/0.8)
    assert probe_retention([0.5, 0.0, 0.8], [0.25, 0.3, 0.8]) == pytest.approx(0.75)
    assert probe_retention([0.0, 0.0], [0.1, 0.2]) is None
    assert probe_retention([], []) is None
    with pytest.raises(ValueError):
        probe_retention([0.5, 0.5], [0.5])


def test_summarize() -> None:
    out = summarize(R3, [0.5, 0.0, 0.8], [0.25, 0.3, 0.8])
    assert set(out) == set(RUN_METRICS) - {"kl_drift"}  # the KL comes from the evaluator
    assert out["average_accuracy"] == pytest.approx(average_accuracy(R3))
    assert out["bwt"] == pytest.approx(-0.25)
    assert out["fwt"] == pytest.approx(0.2)
    assert out["forgetting"] == pytest.approx(0.275)
    assert out["gain"] == pytest.approx(2 / 3)
    assert out["retention"] == pytest.approx(0.75)
    assert out["retention_unclipped"] == pytest.approx(0.75)  # no probe above its base
    single = summarize(R1, [0.0], [0.1])
    assert single["bwt"] is None and single["fwt"] is None and single["forgetting"] is None
    assert single["retention"] is None


# ---- token_kl ---------------------------------------------------------------------------


def _logp(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_token_kl_identical_is_zero() -> None:
    logp = torch.log_softmax(torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0)), -1)
    mask = torch.ones(2, 5, dtype=torch.bool)
    kl = token_kl(logp, logp, mask)
    assert kl.dim() == 0
    assert kl.item() == pytest.approx(0.0, abs=1e-7)


def test_token_kl_hand_computed() -> None:
    p = _logp([[0.5, 0.5], [1.0, 0.0]])
    q = _logp([[0.25, 0.75], [0.5, 0.5]])
    mask = torch.tensor([True, True])
    pos1 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    pos2 = 1.0 * math.log(1.0 / 0.5)  # the p = 0 entry contributes nothing
    assert token_kl(p, q, mask).item() == pytest.approx((pos1 + pos2) / 2)
    # Reverse direction: KL(q || p) is infinite because p = 0 where q > 0.
    assert math.isinf(token_kl(q, p, mask).item())


def test_token_kl_non_negative_and_matches_torch() -> None:
    g = torch.Generator().manual_seed(1)
    lp = torch.log_softmax(torch.randn(3, 7, 13, generator=g) * 3, -1)
    lq = torch.log_softmax(torch.randn(3, 7, 13, generator=g) * 3, -1)
    mask = torch.rand(3, 7, generator=g) > 0.3
    kl = token_kl(lp, lq, mask)
    assert kl.item() >= 0
    ref = torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="none").sum(-1)[mask]
    assert kl.item() == pytest.approx(ref.mean().item(), rel=1e-5)
    assert token_kl(lq, lp, mask).item() >= 0


def test_token_kl_mask_respected() -> None:
    p = _logp([[0.5, 0.5], [1.0, 0.0], [0.9, 0.1]])
    q = _logp([[0.25, 0.75], [0.5, 0.5], [0.1, 0.9]])
    both = token_kl(p[:2], q[:2], torch.tensor([True, True]))
    masked = token_kl(p, q, torch.tensor([True, True, False]))
    assert masked.item() == pytest.approx(both.item())
    # Garbage at a masked-out position (e.g. padding) does not leak in.
    p_bad = p.clone()
    p_bad[2] = float("nan")
    assert token_kl(p_bad, q, torch.tensor([1, 1, 0])).item() == pytest.approx(both.item())
    only_first = token_kl(p, q, torch.tensor([True, False, False]))
    assert only_first.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))


def test_token_kl_finite_with_zero_probs() -> None:
    lp = torch.full((2, 4), float("-inf"))
    lp[:, 0] = 0.0  # one-hot p: log p = [0, -inf, -inf, -inf]
    lq = torch.log_softmax(torch.randn(2, 4, generator=torch.Generator().manual_seed(2)), -1)
    lq.requires_grad_(True)
    kl = token_kl(lp, lq, torch.tensor([True, True]))
    assert torch.isfinite(kl)
    assert kl.item() == pytest.approx((-lq[:, 0]).mean().item())
    kl.backward()
    assert lq.grad is not None and torch.isfinite(lq.grad).all()


def test_token_kl_low_precision_inputs_upcast() -> None:
    lp = torch.log_softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(3)), -1)
    lq = torch.log_softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(4)), -1)
    mask = torch.ones(4, dtype=torch.bool)
    kl16 = token_kl(lp.bfloat16(), lq.bfloat16(), mask)
    assert kl16.dtype == torch.float32
    assert kl16.item() == pytest.approx(token_kl(lp, lq, mask).item(), rel=0.05)


def test_token_kl_shape_errors() -> None:
    lp = torch.log_softmax(torch.zeros(2, 3, 5), -1)
    with pytest.raises(ValueError, match="same shape"):
        token_kl(lp, lp[:, :, :4], torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        token_kl(lp, lp, torch.ones(2, 3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="no positions"):
        token_kl(lp, lp, torch.zeros(2, 3, dtype=torch.bool))


def test_results_name_the_probes_left_out_of_retention() -> None:
    from forgetless.training.results import Results

    results = Results(
        config={"eval": {"forgetting": "learned"}},
        tasks=["a", "b"],
        probes=["gen", "mc"],
        accuracy=[[0.0, 0.0], [0.9, 0.0], [0.5, 0.8]],
        probe_accuracy=[[0.8, 0.2], [0.6, 0.3], [0.4, 0.5]],
        probe_chance=[0.0, 0.25],
        kl_base_to_model=[None] * 3,
        kl_model_to_base=[None] * 3,
    )
    metrics = results.metrics()
    assert metrics["retention"] == pytest.approx(0.5)  # only "gen": 0.4 / 0.8
    assert metrics["probe_retention"]["mc"]["retention"] is None
    assert len(metrics["warnings"]) == 1 and "'mc'" in metrics["warnings"][0]
    assert metrics["forgetting_since"] == "learned"
    assert metrics["forgetting"] == pytest.approx(0.9 - 0.5)
