"""Property-based tests of the metric functions: invariants that follow from docs/metrics.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forgetless.eval.metrics import (
    average_accuracy,
    average_forgetting,
    backward_transfer,
    forward_transfer,
    plasticity_gain,
    probe_retention,
    summarize,
    token_kl,
)

# No subnormal floats: a Runner earlier in the session turns on torch.set_flush_denormal for the
# whole process, and hypothesis refuses to draw subnormals when they flush to zero.
ACC = st.floats(0.0, 1.0, allow_nan=False, allow_subnormal=False)
FAST = settings(max_examples=150, deadline=None)


@st.composite
def matrices(draw: st.DrawFn, min_tasks: int = 1) -> list[list[float]]:
    """A (T + 1) x T accuracy matrix with entries in [0, 1]."""
    tasks = draw(st.integers(min_tasks, 6))
    return [draw(st.lists(ACC, min_size=tasks, max_size=tasks)) for _ in range(tasks + 1)]


def no_forgetting(matrix: list[list[float]]) -> list[list[float]]:
    """The same matrix, but each task keeps the accuracy it had right after it was learned."""
    return [
        [matrix[j][j - 1] if i >= j else row[j - 1] for j in range(1, len(row) + 1)]
        for i, row in enumerate(matrix)
    ]


@FAST
@given(matrices(min_tasks=2))
def test_no_forgetting_gives_zero_bwt_and_zero_forgetting(matrix: list[list[float]]) -> None:
    flat = no_forgetting(matrix)
    assert backward_transfer(flat) == 0.0
    assert average_forgetting(flat, since="learned") == 0.0
    # Chaudhry's reference also counts a zero-shot peak before the task was learned.
    peaks = [max(flat[i][j - 1] for i in range(1, j + 1)) for j in range(1, len(flat) - 1)]
    T = len(flat) - 1
    expected = sum(p - flat[T][j] for j, p in enumerate(peaks)) / (T - 1)
    assert average_forgetting(flat) == pytest.approx(expected, abs=1e-12)


@FAST
@given(matrices(min_tasks=2))
def test_forgetting_bounds_minus_bwt_from_above(matrix: list[list[float]]) -> None:
    """The peak is at least the accuracy right after learning, so F >= -BWT."""
    forgetting, bwt = average_forgetting(matrix), backward_transfer(matrix)
    assert forgetting is not None and bwt is not None
    assert forgetting >= -bwt - 1e-12
    assert -1.0 <= bwt <= 1.0 and -1.0 <= forgetting <= 1.0


@FAST
@given(matrices(min_tasks=2))
def test_forgetting_is_non_negative_when_no_task_ends_above_its_peak(
    matrix: list[list[float]],
) -> None:
    T = len(matrix) - 1
    for j in range(1, T):  # cap each final accuracy at the one after learning the task
        matrix[T][j - 1] = min(matrix[T][j - 1], matrix[j][j - 1])
    forgetting = average_forgetting(matrix)
    assert forgetting is not None and forgetting >= 0.0


@FAST
@given(matrices())
def test_accuracy_decomposes_into_bwt_gain_and_base(matrix: list[list[float]]) -> None:
    """T·ACC = (T-1)·BWT + T·gain + Σ_j R[0, j] (sum the definitions term by term)."""
    T = len(matrix) - 1
    bwt = backward_transfer(matrix) or 0.0
    rhs = (T - 1) * bwt + T * plasticity_gain(matrix) + math.fsum(matrix[0])
    assert T * average_accuracy(matrix) == pytest.approx(rhs, abs=1e-9)
    assert min(matrix[T]) - 1e-12 <= average_accuracy(matrix) <= max(matrix[T]) + 1e-12


@FAST
@given(matrices(), st.floats(-0.5, 0.5, allow_nan=False, allow_subnormal=False))
def test_differences_are_shift_invariant(matrix: list[list[float]], shift: float) -> None:
    moved = [[a + shift for a in row] for row in matrix]
    for metric in (backward_transfer, forward_transfer, average_forgetting, plasticity_gain):
        before, after = metric(matrix), metric(moved)
        if before is None:
            assert after is None and len(matrix) == 2
        else:
            assert after == pytest.approx(before, abs=1e-9)
    assert average_accuracy(moved) == pytest.approx(average_accuracy(matrix) + shift, abs=1e-9)


@FAST
@given(matrices(min_tasks=1))
def test_summarize_matches_the_functions(matrix: list[list[float]]) -> None:
    out = summarize(matrix, [0.5], [0.25])
    assert out["average_accuracy"] == average_accuracy(matrix)
    assert out["bwt"] == backward_transfer(matrix)
    assert out["forgetting"] == average_forgetting(matrix)
    assert out["retention"] == 0.5
    single = len(matrix) == 2
    assert (out["bwt"] is None, out["fwt"] is None, out["forgetting"] is None) == (single,) * 3


@FAST
@given(matrices(), st.integers(0, 6), st.integers(0, 6))
def test_ragged_matrices_are_refused(matrix: list[list[float]], row: int, extra: int) -> None:
    ragged = [list(r) for r in matrix]
    ragged[row % len(ragged)] += [0.5] * (extra + 1)
    with pytest.raises(ValueError, match="accuracy matrix"):
        average_accuracy(ragged)


@FAST
@given(
    st.lists(st.floats(0.01, 1.0, allow_nan=False, allow_subnormal=False), min_size=1, max_size=8),
    st.floats(0.0, 2.0, allow_nan=False, allow_subnormal=False),
)
def test_retention_scales_with_the_current_accuracy(base: list[float], factor: float) -> None:
    assert probe_retention(base, base) == pytest.approx(1.0)
    scaled = probe_retention(base, [factor * b for b in base])
    assert scaled == pytest.approx(min(factor, 1.0), rel=1e-9)
    assert probe_retention([0.0] * len(base), base) is None


@FAST
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 5), st.integers(2, 7))
def test_token_kl_is_non_negative_and_zero_on_itself(
    seed: int, batch: int, length: int, vocab: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(batch, length, vocab, generator=gen) * 3, dim=-1)
    logq = torch.log_softmax(torch.randn(batch, length, vocab, generator=gen) * 3, dim=-1)
    mask = torch.rand(batch, length, generator=gen) > 0.3
    mask[0, 0] = True
    assert float(token_kl(logp, logp, mask)) == pytest.approx(0.0, abs=1e-6)
    kl = float(token_kl(logp, logq, mask))
    assert kl >= -1e-6
    reference = torch.nn.functional.kl_div(logq[mask], logp[mask], log_target=True, reduction="sum")
    assert kl == pytest.approx(float(reference) / int(mask.sum()), rel=1e-4, abs=1e-5)
