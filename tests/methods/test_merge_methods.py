"""Continual merge methods: the model after a task is the merge, and state resumes exactly."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from forgetless.contract import Method, create_method, registered_methods
from forgetless.contract.method import Stage
from forgetless.contract.plan import TrainStats
from forgetless.core.registry import lora_rule_broken
from forgetless.core.storage import load_method_state, save_method_state
from forgetless.diagnostics.geometry import LowRank
from forgetless.merging import ties_merge


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 5)
        self.norm = nn.Parameter(torch.ones(5))


def _method(name: str, **fields: Any) -> Method:
    cls = registered_methods()[name]
    return create_method(cls.config_cls.model_validate({"name": name, **fields}))


def _stage(model: nn.Module, deltas: dict[str, torch.Tensor], regime: str | None = None) -> Stage:
    """A stage whose 'training' adds fixed updates to the weights."""

    def sft(**_: Any) -> TrainStats:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.add_(deltas[n])
        return TrainStats(steps=1)

    ctx = SimpleNamespace(model=model, run=SimpleNamespace(lora_regime=regime))
    return Stage(ctx=ctx, sft=sft, out_dir=Path("."), plan=None)  # type: ignore[arg-type]


def _updates(model: nn.Module, n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {k: torch.randn(p.shape, generator=gen) for k, p in model.named_parameters()}
        for _ in range(n)
    ]


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(method: Method, model: nn.Module, updates: list[dict[str, torch.Tensor]]) -> TrainStats:
    stats = TrainStats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for u in updates:
            stats = method.train_task(_stage(model, u))
    return stats


def test_task_arithmetic_scales_each_update() -> None:
    model = Tiny()
    start, updates = _params(model), _updates(model, 2)
    _run(_method("task_arithmetic", scaling=0.3), model, updates)
    for n, p in model.named_parameters():
        assert torch.allclose(p, start[n] + 0.3 * (updates[0][n] + updates[1][n]), atol=1e-5)


def test_task_arithmetic_with_scaling_zero_stays_at_the_base() -> None:
    model = Tiny()
    start = _params(model)
    _run(_method("task_arithmetic", scaling=0.0), model, _updates(model, 2))
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())


def test_ties_model_is_ties_of_all_updates() -> None:
    model = Tiny()
    start, updates = _params(model), _updates(model, 3)
    _run(_method("ties", density=0.4), model, updates)
    for n, p in model.named_parameters():
        want = start[n] + ties_merge([u[n] for u in updates], 0.4)
        assert torch.allclose(p, want, atol=1e-5), n


def test_opcm_keeps_the_mean_norm_and_projects_the_second_update() -> None:
    model = Tiny()
    start, updates = _params(model), _updates(model, 2)
    method = _method("opcm", alpha=0.5)
    _run(method, model, updates[:1])
    first = {n: p.detach() - start[n] for n, p in model.named_parameters()}
    assert all(torch.allclose(first[n], updates[0][n], atol=1e-5) for n in first)
    stats = _run(method, model, updates[1:])
    merged = {n: p.detach() - start[n] for n, p in model.named_parameters()}
    norm = sum(float(v.pow(2).sum()) for v in merged.values()) ** 0.5
    task_norms = [sum(float(v.pow(2).sum()) for v in u.values()) ** 0.5 for u in updates]
    assert norm == pytest.approx(sum(task_norms) / 2, rel=1e-4)
    added = merged["proj.weight"] * stats.details["opcm_lambda"] - updates[0]["proj.weight"]
    assert abs(float((added * updates[0]["proj.weight"]).sum())) < 1e-3  # ⟂ the first update


def test_gcwm_merges_the_active_updates_with_the_correction() -> None:
    from forgetless.experimental.gcwm import GCWMParams, gcwm_layer

    model = Tiny()
    start, updates = _params(model), _updates(model, 2)
    method = _method("gcwm", rank=5, consensus_ridge=0.0, conflict_cancellation=False)
    _run(method, model, updates[:1])  # one task: the correction vanishes, θ_1 = θ_0 + Δ_1
    assert all(
        torch.allclose(p, start[n] + updates[0][n], atol=1e-5) for n, p in model.named_parameters()
    )
    stats = _run(method, model, updates[1:])
    assert isinstance(method.config, GCWMParams)
    factors = [
        LowRank(u["proj.weight"].double(), torch.eye(6, dtype=torch.float64)) for u in updates
    ]
    correction = gcwm_layer(factors, [1.0, 1.0], method.config).correction.dense().float()
    want = start["proj.weight"] + updates[0]["proj.weight"] + updates[1]["proj.weight"] + correction
    assert torch.allclose(model.proj.weight, want, atol=1e-4)
    assert float(correction.abs().max()) > 1e-3  # the geometry branch did something
    assert torch.allclose(
        model.norm, start["norm"] + updates[0]["norm"] + updates[1]["norm"], atol=1e-5
    )
    assert stats.details["gcwm_layers"] == 1
    (layer,) = stats.details["gcwm_per_layer"].values()  # the gate's distribution, per layer
    assert layer["gate"] == pytest.approx(stats.details["gcwm_gate_mean"])


@pytest.mark.parametrize(("name", "fields"), [("ties", {}), ("opcm", {}), ("gcwm", {"rank": 3})])
def test_resume_from_saved_state_is_exact(
    name: str, fields: dict[str, Any], tmp_path: Path
) -> None:
    updates = _updates(Tiny(), 3, seed=1)
    torch.manual_seed(0)
    straight = Tiny()
    _run(_method(name, **fields), straight, updates)
    torch.manual_seed(0)
    resumed = Tiny()
    first = _method(name, **fields)
    _run(first, resumed, updates[:2])
    save_method_state(tmp_path, first.state_dict())
    second = _method(name, **fields)
    second.load_state_dict(load_method_state(tmp_path))
    _run(second, resumed, updates[2:])
    for (n, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), n


@pytest.mark.parametrize("name", ["task_arithmetic", "ties", "opcm", "gcwm"])
def test_lora_regimes_other_than_carry_are_refused(name: str) -> None:
    method = registered_methods()[name]
    assert lora_rule_broken(method, "lora", "carry") is None
    assert lora_rule_broken(method, "full", "per_task") is None
    broken = lora_rule_broken(method, "lora", "per_task")
    assert broken is not None and "merges the trainable weights" in broken
    assert "regime carry" in broken
