"""Peak memory: CUDA's allocator peak when on GPU, else the process's peak resident set size."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
