"""The forgetting budget's controller: which way each knob moves, its bounds, the adaptive KL
baseline, the learning-rate knob on a live optimizer, and the config rules."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from forgetless.config.budget import BudgetConfig
from forgetless.contract.method import Knob
from forgetless.engine.budget import _scale_lr, adaptive_kl_step, dual_step, relative_violation
from forgetless.testing import tiny_run_config

PENALTY = Knob("lam", keeps_more="higher", low=1.0, high=1e6)
RATE = Knob("lr_scale", keeps_more="lower", low=0.01, high=1.0, learning_rate=True)


def test_over_budget_strengthens_and_under_budget_relaxes() -> None:
    assert relative_violation(0.5, 0.05) == 1.0 and relative_violation(0.0, 0.05) == -1.0
    up = dual_step(100.0, loss=0.10, max_loss=0.05, knob=PENALTY, step_size=0.5)
    down = dual_step(100.0, loss=0.0, max_loss=0.05, knob=PENALTY, step_size=0.5)
    assert up == pytest.approx(100 * math.e**0.5) and down == pytest.approx(100 * math.e**-0.5)
    assert dual_step(100.0, 0.05, 0.05, PENALTY, 0.5) == 100.0  # on the budget: no move
    # a learning rate keeps more when lower: over budget it falls
    assert dual_step(0.5, 0.10, 0.05, RATE, 0.5) == pytest.approx(0.5 * math.e**-0.5)
    assert dual_step(1.0, 0.0, 0.05, RATE, 0.5) == 1.0  # never past the configured rate
    assert dual_step(0.011, 1.0, 0.05, RATE, 0.5) == 0.01  # nor below its bound


def test_the_adaptive_kl_baseline_moves_beta_by_at_most_a_fifth_per_horizon() -> None:
    knob = Knob("beta", keeps_more="higher", low=1e-4, high=10.0)
    assert adaptive_kl_step(0.1, kl=1.0, target=0.1, steps=100, horizon=100, knob=knob) == (
        pytest.approx(0.12)
    )
    assert adaptive_kl_step(0.1, kl=0.0, target=0.1, steps=50, horizon=100, knob=knob) == (
        pytest.approx(0.09)
    )


def test_a_learning_rate_knob_scales_the_running_loop() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    _scale_lr(optimizer, scheduler, 0.25)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4)
    optimizer.step()
    scheduler.step()  # the scheduler recomputes from its base rate: the factor stays
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"method": "replay", "budget": {"controller": "adaptive_kl"}}, "metric kl_to_base"),
        ({"method": "mtl", "budget": {}}, "method 'mtl' has no strength to steer"),
        ({"budget": {}, "probes": []}, "needs probes"),
        ({"budget": {}, "train": {"checkpoint_every": 2}}, "checkpoint_every"),
        (
            {"method": "ewc", "budget": {"controller": "adaptive_kl", "metric": "kl_to_base"}},
            "adaptive_kl steers kl_sft",
        ),
    ],
)
def test_budget_configs_are_checked_at_validate(
    tmp_path: Path, override: dict[str, Any], expected: str
) -> None:
    from forgetless.config.schema import RunConfig

    with pytest.raises(ValidationError, match=expected):
        RunConfig.model_validate(tiny_run_config(tmp_path, **override))
    assert BudgetConfig().every(200) == 10 and BudgetConfig(check_every=3).every(200) == 3


def test_every_declared_knob_is_a_field_its_default_inside_the_bounds() -> None:
    from forgetless.contract import registered_methods
    from forgetless.testing import method_class

    knobs = {n: method_class(n).knob for n in registered_methods()}
    steered = {n for n, k in knobs.items() if k is not None}
    assert {"seq_ft", "low_lr", "ewc", "kl_sft", "sae_fd", "attribution_gate"} <= steered
    for name in steered:
        cls, knob = method_class(name), knobs[name]
        assert knob is not None and 0 < knob.low < knob.high, name
        method = cls(cls.config_cls())
        value = method.knob_value()
        assert knob.low <= value <= knob.high or knob.learning_rate, (name, value)
        method.set_knob(knob.low)
        assert method.knob_value() == (1.0 if knob.learning_rate else knob.low), name


def test_the_attribution_gate_takes_a_new_strength_within_the_task() -> None:
    from forgetless.testing import method_class

    cls = method_class("attribution_gate")
    gate = cls(cls.config_cls())
    layer = torch.nn.Linear(2, 2, bias=False)
    gate.importance = {"weight": torch.tensor([[1.0, 0.5], [0.0, 0.25]])}
    gate._gated = gate._gate_factors(layer, seed=0)
    keep = gate._gated[0][2]  # the tensor the gradient hook multiplies by
    torch.testing.assert_close(keep, torch.tensor([[0.0, 0.5], [1.0, 0.75]]))
    gate.set_knob(0.5)
    torch.testing.assert_close(keep, torch.tensor([[0.5, 0.75], [1.0, 0.875]]))
