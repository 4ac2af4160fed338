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


def test_the_retention_bound_adds_each_probes_binomial_error() -> None:
    from forgetless.training.budget_probe import retention_standard_error

    # one probe at 0.5 of 16 examples above chance 0, one at its base 1.0 (no spread)
    se = retention_standard_error([1.0, 1.0], [0.5, 1.0], [0.0, 0.0], [16, 16])
    assert se == pytest.approx(math.sqrt(0.25 / 16) / 2)
    # a probe with chance 0.25 stretches its error by 1 / (base − chance)
    se = retention_standard_error([0.75], [0.5], [0.25], [16])
    assert se == pytest.approx(math.sqrt(0.25 / 16) / 0.5)
    assert retention_standard_error([0.2], [0.2], [0.25], [16]) == 0.0  # none above chance


def _monitor(losses: list[float], on_violation: str = "rollback") -> Any:
    from forgetless.engine.budget import BudgetMonitor
    from forgetless.testing import method_class

    cls = method_class("ewc")
    config = BudgetConfig(max_loss=0.1, check_every=1, on_violation=on_violation)  # type: ignore[arg-type]
    readings = iter(losses)
    return BudgetMonitor(config, cls(cls.config_cls()), lambda _model: next(readings))


@pytest.mark.parametrize("on_violation", ["rollback", "steer"])
def test_a_check_over_budget_puts_back_the_last_weights_within_it(on_violation: str) -> None:
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    monitor = _monitor([0.05, 0.3, 0.3], on_violation)
    monitor.begin_task(3)
    monitor.loop_started(layer, optimizer, None)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    monitor.after_step(0, layer, optimizer, None)  # within: 1.0 is kept
    with torch.no_grad():
        layer.weight.fill_(2.0)
    monitor.after_step(1, layer, optimizer, None)  # over: back to 1.0 (rollback)
    rolled = on_violation == "rollback"
    assert layer.weight.eq(1.0 if rolled else 2.0).all()
    assert [bool(e.get("rolled_back")) for e in monitor.trace] == [False, rolled]
    assert monitor.trace[1]["next"] > monitor.trace[1]["value"]  # λ strengthened either way
    monitor.loop_finished(2, layer, optimizer, None)  # the last step was no check: one more
    assert len(monitor.trace) == (3 if rolled else 2) and monitor.nothing_kept() is False


def test_the_probe_batch_draws_only_held_out_examples() -> None:
    from forgetless.errors import ConfigError
    from forgetless.tasks.general import build_general_probe
    from forgetless.training.budget_probe import left_out, probe_batch

    mc = build_general_probe("gk-mc", 320, seed=0)  # the whole question set is its evaluation
    short = build_general_probe("gk-short", 96, seed=0)
    assert not mc.train and len(short.train) == 320 - 96
    assert not {e.prompt for e in short.train} & {e.prompt for e in short.eval}
    batch = probe_batch([mc, short], 64)
    assert [p.name for p in batch] == ["gk-short"] and batch[0].eval == short.train[:64]
    assert left_out([mc, short]) == ["gk-mc"]
    with pytest.raises(ConfigError, match="no probe has training examples"):
        probe_batch([mc], 8)
    with pytest.raises(ConfigError, match="'gk-short' has fewer than 300"):
        probe_batch([mc, short], 300)


def test_a_retention_budget_that_cannot_bind_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"max_loss 1\.5 can never bind"):
        BudgetConfig(max_loss=1.5)
    assert BudgetConfig(max_loss=1.5, metric="kl_to_base").max_loss == 1.5  # nats: no cap
    assert BudgetConfig(max_loss=0.99).max_loss == 0.99
