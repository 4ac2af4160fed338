"""What a run ran on and beside: the CPU's name and the load on the machine."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None
