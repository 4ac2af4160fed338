"""Merging functions: task arithmetic, TIES, DARE and OPCM on hand-made and random tensors."""

from __future__ import annotations

import pytest
import torch

from forgetless.merging import (
    dare,
    disjoint_mean,
    elect_sign,
    opcm_accumulate,
    opcm_lambda,
    opcm_project,
    split_rank,
    task_arithmetic,
    task_vector,
    ties_merge,
    trim_top_k,
)
from forgetless.merging.opcm import projection_mask


def test_task_arithmetic_weight_zero_is_base_and_one_task_is_itself() -> None:
    base, tuned = torch.randn(5, 7), torch.randn(5, 7)
    tau = task_vector(base, tuned)
    assert torch.equal(task_arithmetic(base, [tau, -tau], [0.0, 0.0]), base)
    assert torch.allclose(task_arithmetic(base, [tau], [1.0]), tuned, atol=1e-6)
    half = task_arithmetic(base, [tau, 2 * tau], [0.5, 0.25])
    assert torch.allclose(half, base + tau, atol=1e-6)


def test_task_arithmetic_keeps_the_base_dtype() -> None:
    base = torch.randn(3, 3).to(torch.bfloat16)
    assert task_arithmetic(base, [torch.ones(3, 3)], [1.0]).dtype == torch.bfloat16


def test_trim_keeps_the_largest_magnitudes() -> None:
    delta = torch.tensor([0.1, -3.0, 0.5, 2.0, -0.2])
    assert torch.equal(trim_top_k(delta, 0.4), torch.tensor([0.0, -3.0, 0.0, 2.0, 0.0]))
    assert torch.equal(trim_top_k(delta, 1.0), delta)
    assert torch.equal(trim_top_k(delta, 0.0), torch.zeros(5))


def test_ties_elects_the_heavier_sign_and_averages_agreeing_entries() -> None:
    # entry 0: +1, +2, −4 → mass −1 → sign −, only the −4 agrees → −4
    # entry 1: +1, +2, −2 → sign + → mean of 1 and 2 = 1.5
    # entry 2: 0, 0, +3 → + → 3 (zeros do not count in the mean)
    taus = [
        torch.tensor([1.0, 1.0, 0.0]),
        torch.tensor([2.0, 2.0, 0.0]),
        torch.tensor([-4.0, -2.0, 3.0]),
    ]
    sign = elect_sign(taus)
    assert torch.equal(sign, torch.tensor([-1.0, 1.0, 1.0]))
    assert torch.allclose(disjoint_mean(taus, sign), torch.tensor([-4.0, 1.5, 3.0]))
    assert torch.allclose(ties_merge(taus, density=1.0), torch.tensor([-4.0, 1.5, 3.0]))


def test_ties_with_weight_zero_and_of_one_task() -> None:
    tau = torch.randn(4, 6)
    assert torch.equal(ties_merge([tau, -tau], 0.5, [0.0, 0.0]), torch.zeros(4, 6))
    assert torch.equal(ties_merge([tau], 1.0), tau)


def test_dare_with_p_zero_is_the_identity_and_is_seeded() -> None:
    delta = torch.randn(10, 10)
    assert torch.equal(dare(delta, 0.0, torch.Generator().manual_seed(0)), delta)
    a = dare(delta, 0.7, torch.Generator().manual_seed(3))
    b = dare(delta, 0.7, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    kept = a != 0
    assert torch.allclose(a[kept], delta[kept] / 0.3)
    with pytest.raises(ValueError):
        dare(delta, 1.0, torch.Generator())


def test_dare_preserves_the_expectation() -> None:
    delta = torch.linspace(-1, 1, 64)
    gen = torch.Generator().manual_seed(0)
    mean = torch.stack([dare(delta, 0.5, gen) for _ in range(4000)]).mean(0)
    # std of the mean per entry: |δ|·sqrt(p/(1−p))/sqrt(n) ≤ 1/63 → 5σ ≈ 0.08
    assert (mean - delta).abs().max() < 0.08
    drop_share = float((dare(torch.ones(100_000), 0.3, gen) == 0).float().mean())
    assert abs(drop_share - 0.3) < 0.01


def test_split_rank_counts_the_protected_directions() -> None:
    s = torch.tensor([5.0, 3.0, 1.0, 1.0])  # shares 0.5, 0.8, 0.9, 1.0
    assert split_rank(s, 0.5) == 1
    assert split_rank(s, 0.85) == 2
    assert split_rank(s, 0.0) == 0
    assert split_rank(torch.zeros(3), 0.5) == 0


def test_opcm_projection_is_orthogonal_to_the_merged_update() -> None:
    merged = torch.randn(12, 5) @ torch.randn(5, 9)
    delta = torch.randn(12, 9)
    projected = opcm_project(delta, merged, alpha=0.5)
    u, s, vh = torch.linalg.svd(merged.double(), full_matrices=False)
    keep = int((s > 1e-8 * s.max()).sum())
    coeff = u[:, :keep].T @ projected.double() @ vh[:keep].T
    mask = projection_mask(keep, split_rank(s[:keep], 0.5))
    assert coeff[mask].abs().max() < 1e-5  # no component on a removed direction u_i v_jᵀ
    assert abs(float((projected.double() * merged.double()).sum())) < 1e-4  # ⟨τ̃, R⟩ = 0
    again = opcm_project(projected, merged, alpha=0.5)
    assert torch.allclose(again, projected, atol=1e-5)  # a projection: idempotent
    residual = delta - projected  # and orthogonal: the removed part ⟂ the kept part
    assert abs(float((residual.double() * projected.double()).sum())) < 1e-4


def test_opcm_of_a_zero_merged_update_keeps_the_task_vector() -> None:
    delta = torch.randn(4, 4)
    assert torch.equal(opcm_project(delta, torch.zeros(4, 4), 0.5), delta)
    assert torch.equal(opcm_accumulate(None, delta, 0.5, True), delta)
    assert torch.equal(opcm_accumulate(delta, delta, 0.5, False), 2 * delta)


def test_opcm_lambda_keeps_the_mean_task_norm() -> None:
    assert opcm_lambda(6.0, [2.0, 4.0]) == pytest.approx(2.0)
    assert opcm_lambda(0.0, [1.0]) == 1.0


def test_one_default_per_rule_for_the_merge_and_the_method() -> None:
    from forgetless.merging.config import OPCMMerge, TaskArithmeticMerge, TiesMerge
    from forgetless.methods.opcm import OPCMConfig
    from forgetless.methods.task_arithmetic import TaskArithmeticConfig
    from forgetless.methods.ties import TiesConfig

    pairs = [
        (TaskArithmeticMerge(name="task_arithmetic"), TaskArithmeticConfig()),
        (TiesMerge(name="ties"), TiesConfig()),
        (OPCMMerge(name="opcm"), OPCMConfig()),
    ]
    for merge, method in pairs:  # the merge may add merge-only fields (mergekit's normalize)
        assert method.model_dump().items() <= merge.model_dump().items()


def test_kept_count_rounds_as_the_paper_or_as_mergekit() -> None:
    from forgetless.merging.ties import kept_count

    assert kept_count(10, 0.25) == 3 and kept_count(10, 0.25, "floor") == 2
    assert kept_count(3, 0.2, "floor") == 1  # mergekit keeps at least one entry
    assert kept_count(100, 0.2) == 20  # float32 ceil: 0.2·100 is not 21


def test_mergekit_ties_by_hand() -> None:
    # two tasks, weights 1 and 0.5, density 1 (no trimming): entry 0 agrees (+), entry 1 splits
    # (+2·1 against −3·0.5: + wins), entry 2 sums to exactly 0 (+ wins, as in mergekit).
    a, b = torch.tensor([1.0, 2.0, 1.0]), torch.tensor([4.0, -3.0, -2.0])
    merged = ties_merge([a, b], 1.0, [1.0, 0.5], convention="mergekit")
    expected = torch.tensor([(1.0 + 2.0) / 1.5, 2.0 / 1.0, 1.0 / 1.0])
    torch.testing.assert_close(merged, expected)
    summed = ties_merge([a, b], 1.0, [1.0, 0.5], convention="mergekit", normalize=False)
    torch.testing.assert_close(summed, torch.tensor([3.0, 2.0, 1.0]))
    paper = ties_merge([a, b], 1.0, [1.0, 0.5])
    torch.testing.assert_close(paper, torch.tensor([1.5, 2.0, 0.0]))
