"""The public API of docs/api.md: a method written outside the package, registered and run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from conftest import tiny_run_config
from pydantic import Field
from rich.console import Console

import forgetless
from forgetless import Capability, Method, MethodConfig, register_method


class PullBackConfig(MethodConfig):
    name: Literal["pull_back"] = "pull_back"
    strength: float = Field(1.0, ge=0, description="λ on Σ ‖θ − θ_start‖².")


@register_method
class PullBack(Method):
    name = "pull_back"
    config_cls = PullBackConfig
    capabilities = frozenset({Capability.TASK_START, Capability.LOSS_TERMS})

    def on_task_start(self, ctx: Any) -> None:
        self.start = {
            n: p.detach().clone() for n, p in ctx.model.named_parameters() if p.requires_grad
        }

    def loss_terms(self, batch: Any, outputs: Any, ctx: Any) -> dict[str, torch.Tensor]:
        params = dict(ctx.task.model.named_parameters())
        pull = sum((params[n] - s).pow(2).sum() for n, s in self.start.items())
        assert isinstance(self.config, PullBackConfig)
        return {"pull_back": self.config.strength * pull}


def test_public_names_resolve_lazily() -> None:
    assert forgetless.Runner.__name__ == "Runner"
    assert forgetless.RunConfig.__name__ == "RunConfig"
    assert set(forgetless.__all__) <= set(dir(forgetless))
    with pytest.raises(AttributeError):
        _ = forgetless.NoSuchThing  # type: ignore[attr-defined]


def test_a_method_from_outside_the_package_runs_and_is_recorded(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = tiny_run_config(tiny_model_dir, method={"name": "pull_back", "strength": 0.5})
    cfg = forgetless.validate_config(data)
    assert isinstance(cfg.method, PullBackConfig) and cfg.method.strength == 0.5
    results = forgetless.Runner(cfg, tmp_path / "out", Console(quiet=True), progress=False).run()
    terms = results.per_task[-1]["loss_terms"]
    assert terms["pull_back"] > 0  # the second task moved away from where it started
    assert results.config["method"] == {"name": "pull_back", "strength": 0.5}
