"""Peak memory of the code timed in a benchmark subprocess, shared by the overhead benchmarks.

CUDA's allocator peak on a GPU. On the CPU the kernel's resident-set high-water mark (``VmHWM``),
reset after the warm-up where Linux allows it, so that the peak is the timed steps' and not the
imports' (which outweigh a tiny model); else ``ru_maxrss``, which never goes down.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch


def status_kb(field: str) -> float | None:
    """A ``/proc/self/status`` memory field in KiB (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return float(line.split()[1])
    except OSError:
        return None
    return None


def start_window(device: torch.device) -> bool:
    """Start the measured window: reset the peak; True when the CPU high-water mark was reset."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return False
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return status_kb("VmHWM") is not None


def peak_mb(device: torch.device, hwm_reset: bool) -> tuple[float, str]:
    """The window's peak in MiB and how it was measured (cuda, vmhwm or ru_maxrss)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20, "cuda"
    if hwm_reset:
        return (status_kb("VmHWM") or 0.0) / 2**10, "vmhwm"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), "ru_maxrss"
