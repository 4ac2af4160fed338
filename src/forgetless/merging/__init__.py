"""Merging task updates: pure tensor functions, and a streaming merge over safetensors.

GCWM lives in ``forgetless.experimental`` until its tests and bench rows stand: importing
``forgetless.experimental.gcwm_merge`` registers it as a rule of the streaming merge
(``register_tensor_rule``), so this floor never imports the experimental corner.
"""

from forgetless.merging.dare import dare
from forgetless.merging.opcm import opcm_accumulate, opcm_lambda, opcm_project, split_rank
from forgetless.merging.task_arithmetic import task_arithmetic, task_vector, weighted_sum
from forgetless.merging.ties import disjoint_mean, elect_sign, ties_merge, trim_top_k

__all__ = [
    "dare",
    "disjoint_mean",
    "elect_sign",
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
