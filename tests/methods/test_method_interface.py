"""The method interface serves every kind of hook the planned methods need, through one runner."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from torch import nn

from forgetless.config.loading import validate_config
from forgetless.contract.method import (
    Capability,
    Method,
    MethodConfig,
    Stage,
    StepContext,
    TaskContext,
    TaskEndContext,
    check_method_class,
    register_method,
)
from forgetless.contract.plan import TrainStats
from forgetless.engine.loop import causal_lm_loss
from forgetless.training.runner import Runner


class ProbeConfig(MethodConfig):
    name: Literal["probe"] = "probe"


def run_with(method: Method, model_dir: Path, out: Path, **overrides: Any) -> dict[str, Any]:
    cfg = validate_config(tiny_run_config(model_dir, **overrides))
    return Runner(cfg, out, Console(quiet=True), progress=False, method=method).run().to_json()


class L2ToStart(Method):
    """Loss terms + task start + state: pull weights toward their values at task start."""

    name = "l2_probe"
    config_cls = ProbeConfig
    capabilities = frozenset({Capability.TASK_START, Capability.LOSS_TERMS, Capability.STATE})

    def on_task_start(self, ctx: TaskContext) -> None:
        self.start = {
            n: p.detach().clone() for n, p in ctx.model.named_parameters() if p.requires_grad
        }
        self.tasks_seen = getattr(self, "tasks_seen", 0) + 1

    def loss_terms(self, batch: Any, outputs: Any, ctx: StepContext) -> dict[str, torch.Tensor]:
        params = dict(ctx.task.model.named_parameters())
        return {"l2": sum(((params[n] - p0) ** 2).sum() for n, p0 in self.start.items())}  # type: ignore[dict-item]

    def state_dict(self) -> dict[str, Any]:
        return {"tasks_seen": self.tasks_seen, "start": dict(self.start)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tasks_seen, self.start = state["tasks_seen"], state["start"]


def test_named_loss_terms_are_logged_and_state_is_saved(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    results = run_with(L2ToStart(ProbeConfig()), tiny_model_dir, tmp_path)
    for stats in results["per_task"]:
        assert set(stats["loss_terms"]) == {"task", "l2"}
        assert stats["loss_terms"]["l2"] > 0
    resumed = L2ToStart(ProbeConfig())
    from forgetless.core.storage import load_method_state

    resumed.load_state_dict(load_method_state(tmp_path / "checkpoints" / "task-02-cipher"))
    assert resumed.tasks_seen == 2 and resumed.start


class FreezeEmbeddings(Method):
    """Update gate: restore one projection from the pre-step weights after each step."""

    name = "gate_probe"
    config_cls = ProbeConfig
    capabilities = frozenset({Capability.UPDATE_GATE})

    def gate_update(
        self, model: nn.Module, pre_step: dict[str, torch.Tensor], ctx: StepContext
    ) -> None:
        for name, param in model.named_parameters():
            if "layers.0.self_attn.q_proj" in name:
                param.copy_(pre_step[name])


def test_update_gate_sees_pre_step_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run_with(FreezeEmbeddings(ProbeConfig()), tiny_model_dir, tmp_path)
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "checkpoints" / "task-02-cipher" / "model.safetensors"))
    key = next(k for k in after if "layers.0.self_attn.q_proj.weight" in k)
    assert torch.equal(before[key], after[key])
    changed = [k for k in after if "layers.0.mlp.up_proj" in k]
    assert changed and not torch.equal(before[changed[0]], after[changed[0]])


class ZeroLoss(Method):
    """Replace loss: a loss with no gradient signal leaves every weight in place."""

    name = "zero_probe"
    config_cls = ProbeConfig
    capabilities = frozenset({Capability.REPLACE_LOSS})

    def task_loss(self, batch: Any, outputs: Any, ctx: StepContext) -> torch.Tensor:
        return outputs.logits.sum() * 0.0


def test_replaced_loss_is_what_trains(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run_with(ZeroLoss(ProbeConfig()), tiny_model_dir, tmp_path)
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "checkpoints" / "task-01-reverse" / "model.safetensors"))
    common = set(before) & set(after)
    assert len(common) > 10
    assert all(torch.equal(before[k], after[k]) for k in common)


class Recorder(Method):
    """Batch transform, activation hooks, a model transform and end-of-task work, all recorded."""

    name = "recorder_probe"
    config_cls = ProbeConfig
    capabilities = frozenset(
        {
            Capability.BATCH_TRANSFORM,
            Capability.ACTIVATION_HOOKS,
            Capability.MODEL_TRANSFORM,
            Capability.TASK_END,
        }
    )

    def __init__(self, config: MethodConfig) -> None:
        super().__init__(config)
        self.batch_sizes: list[int] = []
        self.hook_calls = 0
        self.eval_calls = 0
        self.ends: list[TaskEndContext] = []

    def transform_batch(self, features: list[Any], ctx: StepContext) -> list[Any]:
        self.batch_sizes.append(len(features))
        return features + features[:1]

    def register_hooks(self, ctx: TaskContext) -> list[Any]:
        def count(*_: Any) -> None:
            self.hook_calls += 1

        return [ctx.model.get_submodule("model.layers.0.mlp").register_forward_hook(count)]

    def transform_model(self, model: nn.Module, ctx: TaskContext) -> nn.Module:
        evaluated = copy.deepcopy(model)

        def count(*_: Any) -> None:
            self.eval_calls += 1

        evaluated.register_forward_hook(count)
        return evaluated

    def on_task_end(self, ctx: TaskEndContext) -> None:
        self.ends.append(ctx)


def test_batch_hooks_transform_and_task_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    method = Recorder(ProbeConfig())
    run_with(method, tiny_model_dir, tmp_path)
    assert method.batch_sizes == [8] * 8
    assert method.hook_calls == 8, "hooks fire during training only and are removed afterwards"
    assert method.eval_calls > 0, "the transformed model is the one evaluated"
    assert [e.task.task.name for e in method.ends] == ["reverse", "cipher"]
    end = method.ends[-1]
    assert set(end.eval_results) == {"reverse", "cipher", "copy"}
    assert len(end.eval_results["reverse"].correct) == 8
    assert len(end.task.train_features) == 32 and end.stats.steps == 4


class TwoStage(Method):
    """Train stage: outer loop of two inner SFT calls through the shared loop, own loss."""

    name = "stage_probe"
    config_cls = ProbeConfig
    capabilities = frozenset({Capability.TRAIN_STAGE})
    losses: ClassVar[list[str]] = []

    def train_task(self, stage: Stage) -> TrainStats:
        def loss(batch: Any, outputs: Any, ctx: StepContext) -> torch.Tensor:
            self.losses.append(ctx.task.task.name)
            return causal_lm_loss(outputs.logits, batch["labels"])

        first = stage.sft(steps=2, loss_fn=loss)
        second = stage.sft(features=stage.ctx.train_features[:8], steps=3, lr=1e-4)
        return TrainStats(steps=first.steps + second.steps, seconds=first.seconds + second.seconds)


def test_train_stage_drives_the_shared_loop(tiny_model_dir: Path, tmp_path: Path) -> None:
    results = run_with(TwoStage(ProbeConfig()), tiny_model_dir, tmp_path)
    assert [s["steps"] for s in results["per_task"]] == [5, 5]
    assert TwoStage.losses == ["reverse"] * 2 + ["cipher"] * 2


def test_registration_checks_capabilities_against_hooks() -> None:
    class Undeclared(Method):
        name = "undeclared"
        config_cls = ProbeConfig

        def on_task_end(self, ctx: TaskEndContext) -> None:
            return None

    class Missing(Method):
        name = "missing"
        config_cls = ProbeConfig
        capabilities = frozenset({Capability.LOSS_TERMS})

    with pytest.raises(TypeError, match="without declaring task_end"):
        check_method_class(Undeclared)
    with pytest.raises(TypeError, match="lacks loss_terms"):
        check_method_class(Missing)
    with pytest.raises(TypeError, match="Literal"):
        register_method(type("Bad", (Method,), {"name": "bad", "config_cls": ProbeConfig}))


def test_duplicate_registration_is_rejected() -> None:
    from forgetless.methods.seq_ft import SeqFT

    with pytest.raises(ValueError, match="already registered"):
        register_method(SeqFT)
