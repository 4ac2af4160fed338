"""A run under a forgetting budget: the knob's trace lands in results.json per task, it moves the
way the budget asks, and a budget that cannot be kept is said in one line, never silently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_runs import cli, results, write_config

from forgetless.testing import tiny_run_config


def _budget_run(
    model_dir: Path, tmp_path: Path, method: Any, max_loss: float, on_violation: str = "rollback"
) -> dict[str, Any]:
    budget = {
        "metric": "kl_to_base",
        "max_loss": max_loss,
        "check_every": 2,
        "probe_batch": 8,
        "on_violation": on_violation,
    }
    config = write_config(tmp_path, tiny_run_config(model_dir, method=method, budget=budget))
    cli(config, tmp_path / "out")
    return results(tmp_path / "out")


def test_a_budget_out_of_reach_strengthens_the_method_and_says_so(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    method = {"name": "ewc", "lam": 100.0, "fisher_samples": 4, "fisher_batch_size": 4}
    data = _budget_run(tiny_model_dir, tmp_path, method, max_loss=1e-9, on_violation="steer")
    first, second = (task["budget"] for task in data["per_task"])
    assert first["knob"] == "lam" and first["checks"] == 2  # 4 steps, a check every 2
    values = [e["value"] for e in first["trace"] + second["trace"]] + [second["end_value"]]
    assert values == sorted(values) and values[-1] > values[0] * 2  # λ climbs every check
    assert not second["kept"] and "budget not kept after task" in second["warning"]
    assert {"type": "budget", "action": "not_kept", "task": "cipher"} in data["events"]


def test_under_rollback_a_budget_out_of_reach_leaves_the_weights_where_they_were(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = _budget_run(tiny_model_dir, tmp_path, "seq_ft", max_loss=1e-9)
    for task in data["per_task"]:
        budget = task["budget"]
        assert budget["rollbacks"] == budget["checks"] == 2
        assert budget["kept"] and "cannot be learned inside the budget" in budget["warning"]
    # every task rolled back to the base: the probes' KL to it is zero
    assert data["kl_drift"]["base_to_model"][-1] == pytest.approx(0.0, abs=1e-6)
    assert [e["action"] for e in data["events"]] == ["not_learned", "not_learned"]


@pytest.mark.slow
def test_a_loose_budget_lets_the_learning_rate_rise_to_the_configured_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = _budget_run(tiny_model_dir, tmp_path, "seq_ft", max_loss=100.0)
    budget = data["per_task"][-1]["budget"]
    assert budget["knob"] == "lr_scale" and budget["kept"] and "warning" not in budget
    assert {e["value"] for e in budget["trace"]} == {1.0}  # already at its ceiling
    assert not data["events"]
