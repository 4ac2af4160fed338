"""EWC: the penalty's math, Fisher-weighted pull toward the last task's weights, state, LoRA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from safetensors.torch import load_file

from forgetless.config.loading import validate_config
from forgetless.contract.method import Capability, StepContext
from forgetless.core.storage import load_method_state
from forgetless.errors import ConfigError
from forgetless.methods.ewc import EWC, EWCConfig, ewc_penalty, online_fisher
from forgetless.training.runner import Runner

TRAIN = {"steps": 4, "batch_size": 8, "lr": 1e-3, "max_length": 32}
EWC_CASE = {"name": "ewc", "lam": 1e5, "fisher_samples": 32, "fisher_batch_size": 4}


def run(model_dir: Path, out: Path, method: Any, **overrides: Any) -> dict[str, Any]:
    instance = None if isinstance(method, dict | str) else method
    raw = tiny_run_config(model_dir, train=TRAIN, **overrides)
    if instance is None:
        raw["method"] = method
    cfg = validate_config(raw)
    return Runner(cfg, out, Console(quiet=True), progress=False, method=instance).run().to_json()


def test_penalty_is_zero_at_the_anchor_and_its_gradient_is_lambda_f_delta() -> None:
    anchor = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    fisher = {"w": torch.rand(3, 4), "b": torch.rand(4)}
    at_anchor = {n: t.clone().requires_grad_() for n, t in anchor.items()}
    assert ewc_penalty(at_anchor, fisher, anchor, lam=7.0).item() == 0.0
    params = {n: (t + torch.randn_like(t)).requires_grad_() for n, t in anchor.items()}
    penalty = ewc_penalty(params, fisher, anchor, lam=7.0)
    expected = sum(0.5 * 7.0 * (fisher[n] * (params[n] - anchor[n]) ** 2).sum() for n in anchor)
    assert penalty.detach().item() == pytest.approx(float(expected), rel=1e-6)
    penalty.backward()
    for n in anchor:
        want = 7.0 * fisher[n] * (params[n].detach() - anchor[n])
        torch.testing.assert_close(params[n].grad, want)


def test_online_fisher_decays_the_old_estimate() -> None:
    old = {"a": torch.full((2,), 4.0), "gone": torch.ones(1)}
    new = {"a": torch.ones(2), "fresh": torch.full((1,), 3.0)}
    out = online_fisher(old, new, gamma=0.5)
    torch.testing.assert_close(out["a"], torch.full((2,), 3.0))
    torch.testing.assert_close(out["gone"], torch.full((1,), 0.5))
    torch.testing.assert_close(out["fresh"], new["fresh"])
    assert out["fresh"] is not new["fresh"]
    assert online_fisher(None, new, gamma=1.0).keys() == new.keys()


def _movement(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str]) -> Any:
    return torch.cat([(b[k] - a[k]).abs().flatten() for k in keys])


def test_large_fisher_weights_are_pulled_back_more(tiny_model_dir: Path, tmp_path: Path) -> None:
    run(tiny_model_dir, tmp_path / "seq", "seq_ft")
    ewc = run(tiny_model_dir, tmp_path / "ewc", EWC_CASE)
    assert ewc["per_task"][0]["loss_terms"]["ewc"] == 0.0, "no penalty before the first task ends"
    assert ewc["per_task"][1]["loss_terms"]["ewc"] > 0.0

    def weights(run_dir: str, task: str) -> dict[str, torch.Tensor]:
        return load_file(str(tmp_path / run_dir / "checkpoints" / task / "model.safetensors"))

    s1, s2 = weights("seq", "task-01-reverse"), weights("seq", "task-02-cipher")
    e1, e2 = weights("ewc", "task-01-reverse"), weights("ewc", "task-02-cipher")
    assert all(torch.equal(s1[k], e1[k]) for k in s1), "task 1 trains as plain SFT"
    state = load_file(str(tmp_path / "ewc/checkpoints/task-01-reverse/method_state.safetensors"))
    keys = [k for k in s1 if f"fisher/{k}" in state]
    assert set(s1) - set(keys) <= {"lm_head.weight"}, "every weight but a tied head has a Fisher"
    fisher = torch.cat([state[f"fisher/{k}"].flatten() for k in keys])
    moved_seq, moved_ewc = _movement(s1, s2, keys), _movement(e1, e2, keys)
    order, tenth = fisher.argsort(), fisher.numel() // 10
    top, bottom = order[-tenth:], order[:tenth]
    ratio_top = moved_ewc[top].mean() / moved_seq[top].mean()
    ratio_bottom = moved_ewc[bottom].mean() / moved_seq[bottom].mean()
    assert ratio_top < 0.75 and ratio_top < ratio_bottom - 0.2, (ratio_top, ratio_bottom)


def test_state_round_trip_after_a_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    method = EWC(EWCConfig(lam=1e5, fisher_samples=8, fisher_batch_size=4, gamma=0.5))
    run(tiny_model_dir, tmp_path, method)
    assert method.uses(Capability.STATE) and set(method.reduce_ops) == {"fisher"}
    state = load_method_state(tmp_path / "checkpoints" / "task-02-cipher")
    restored = EWC(method.config)
    restored.load_state_dict(state)
    assert restored.fisher.keys() == method.fisher.keys() == restored.anchor.keys()
    for n in method.fisher:
        torch.testing.assert_close(restored.fisher[n], method.fisher[n].cpu())
        torch.testing.assert_close(restored.anchor[n], method.anchor[n].cpu())
    assert all(bool((f >= 0).all()) for f in method.fisher.values())


class CrashAt(EWC):
    """EWC that dies at a given task and step, as a killed process would."""

    capabilities = EWC.capabilities | {Capability.BATCH_TRANSFORM}

    def __init__(self, task: int, step: int) -> None:
        super().__init__(EWCConfig.model_validate(EWC_CASE))
        self.where = (task, step)

    def transform_batch(self, features: list[Any], ctx: StepContext) -> list[Any]:
        if (ctx.task.task_index, ctx.step) == self.where:
            raise KeyboardInterrupt("simulated crash")
        return features


def test_lora_fisher_is_over_the_adapter_and_resume_matches(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    lora = {"finetune": {"mode": "lora", "lora": {"r": 2}}}
    full = run(tiny_model_dir, tmp_path / "full", EWC(EWCConfig.model_validate(EWC_CASE)), **lora)
    assert full["per_task"][1]["loss_terms"]["ewc"] > 0.0
    meta = json.loads((tmp_path / "full/checkpoints/task-01-reverse/method_state.json").read_text())
    assert meta["fisher"] and all(".lora_" in k and ".default." in k for k in meta["fisher"])
    with pytest.raises(KeyboardInterrupt):
        run(tiny_model_dir, tmp_path / "crash", CrashAt(task=2, step=2), **lora)
    resumed = run(
        tiny_model_dir, tmp_path / "crash", EWC(EWCConfig.model_validate(EWC_CASE)), **lora
    )
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["kl_drift"] == full["kl_drift"]
    assert resumed["per_task"][1]["loss_terms"] == full["per_task"][1]["loss_terms"]


def test_lora_regimes_without_a_carried_adapter_are_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    lora = {"mode": "lora", "lora": {"r": 2, "regime": "per_task"}}
    with pytest.raises(ConfigError, match="regime carry"):
        run(tiny_model_dir, tmp_path, EWC_CASE, finetune=lora)
