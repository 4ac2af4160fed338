"""Low-SFT: registered under its name, and the optimizer really runs at the scaled rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from safetensors.torch import load_file

from forgetless.config.loading import validate_config
from forgetless.contract import registered_methods
from forgetless.errors import ConfigError
from forgetless.methods.low_lr import LowLR, LowLRConfig
from forgetless.training.runner import Runner

ONE_STEP = {"steps": 1, "batch_size": 8, "lr": 1e-3, "max_length": 32}


def run_weights(model_dir: Path, out: Path, method: Any) -> dict[str, torch.Tensor]:
    raw = tiny_run_config(model_dir, method=method, tasks=["reverse"], train=ONE_STEP)
    Runner(validate_config(raw), out, Console(quiet=True), progress=False).run()
    return load_file(str(out / "checkpoints" / "task-01-reverse" / "model.safetensors"))


def test_registered_and_validated() -> None:
    assert registered_methods()["low_lr"] is LowLR
    assert LowLRConfig().lr_scale == 0.1
    cfg = validate_config(tiny_run_config(Path("."), method={"name": "low_lr", "lr_scale": 0.5}))
    assert isinstance(cfg.method, LowLRConfig) and cfg.method.lr_scale == 0.5
    with pytest.raises(ConfigError, match="lr_scale"):
        validate_config(tiny_run_config(Path("."), method={"name": "low_lr", "lr_scale": 0}))


def test_one_adam_step_moves_weights_by_the_scaled_rate(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """AdamW's first step is lr·g/(|g|+eps) per weight: the same gradient, a tenth of the step."""
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    seq = run_weights(tiny_model_dir, tmp_path / "seq", "seq_ft")
    low = run_weights(tiny_model_dir, tmp_path / "low", {"name": "low_lr", "lr_scale": 0.1})
    keys = sorted(set(base) & set(seq))
    d_seq = torch.cat([(seq[k] - base[k]).flatten() for k in keys])
    d_low = torch.cat([(low[k] - base[k]).flatten() for k in keys])
    moved = d_seq.abs() > 0.5 * ONE_STEP["lr"]
    assert int(moved.sum()) > 1000
    ratio = d_low[moved] / d_seq[moved]  # float32 rounding of w + Δw limits the precision
    torch.testing.assert_close(ratio, torch.full_like(ratio, 0.1), rtol=2e-3, atol=0.0)
    assert bool((d_low[~moved].abs() <= 0.1 * 0.5 * ONE_STEP["lr"] + 1e-7).all())


def test_scale_one_is_seq_ft(tiny_model_dir: Path, tmp_path: Path) -> None:
    seq = run_weights(tiny_model_dir, tmp_path / "seq", "seq_ft")
    same = run_weights(tiny_model_dir, tmp_path / "low", {"name": "low_lr", "lr_scale": 1.0})
    assert all(torch.equal(seq[k], same[k]) for k in seq)
