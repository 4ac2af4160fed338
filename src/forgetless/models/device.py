"""The run's ``device`` setting against what this machine has, refused in one line when absent."""

from __future__ import annotations

import torch

from forgetless.errors import ConfigError


def _cuda(setting: str) -> torch.device:
    if not torch.cuda.is_available():
        raise ConfigError(f"device: {setting}: no CUDA device is available here; use auto or cpu")
    device = torch.device(setting)
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(
            f"device: {setting}: this machine has {count} CUDA device(s), cuda:0 to "
            f"cuda:{count - 1}"
        )
    return device


def _mps() -> torch.device:
    if not torch.backends.mps.is_available():
        raise ConfigError("device: mps: no Apple GPU (MPS) is available here; use auto or cpu")
    return torch.device("mps")


def pick_device(setting: str, placed: torch.device, processes: int) -> torch.device:
    """The device the run uses: ``placed`` (where accelerate put this process) for ``auto``,
    else the one named, when this machine has it. A launch of several processes places each
    process itself, so it takes ``auto`` only."""
    if setting == "auto":
        return placed
    if processes > 1:
        raise ConfigError(
            f"device: {setting}: a launch of {processes} processes places each on its own "
            "device; leave device auto"
        )
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "mps":
        return _mps()
    return _cuda(setting)


def describe(device: torch.device, setting: str, weights: torch.dtype, autocast: str) -> str:
    """The start-up line: where the model runs and in which dtype."""
    where = f"{device} (auto)" if setting == "auto" else str(device)
    dtype = str(weights).removeprefix("torch.")
    under = ", training under bf16 autocast" if autocast == "bf16" else ""
    return f"device: {where}, dtype: {dtype}{under}"
