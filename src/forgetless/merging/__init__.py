"""Merging task updates: pure tensor functions, and a streaming merge over safetensors.

GCWM lives in ``forgetless.experimental.gcwm`` until its tests and bench rows stand; the stable
merge loads it on demand (``experimental_gcwm``), never at import.
"""

import importlib
from types import ModuleType

from forgetless.merging.dare import dare
from forgetless.merging.opcm import opcm_accumulate, opcm_lambda, opcm_project, split_rank
from forgetless.merging.task_arithmetic import task_arithmetic, task_vector, weighted_sum
from forgetless.merging.ties import disjoint_mean, elect_sign, ties_merge, trim_top_k


def experimental_gcwm() -> ModuleType:
    """``forgetless.experimental.gcwm``, imported when a GCWM merge first needs it (it warns)."""
    return importlib.import_module("forgetless.experimental.gcwm")


__all__ = [
    "dare",
    "disjoint_mean",
    "elect_sign",
    "experimental_gcwm",
    "opcm_accumulate",
    "opcm_lambda",
    "opcm_project",
    "split_rank",
    "task_arithmetic",
    "task_vector",
    "ties_merge",
    "trim_top_k",
    "weighted_sum",
]
