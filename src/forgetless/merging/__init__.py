"""Merging task updates: pure tensor functions, and a streaming merge over safetensors.

A merge method from outside this floor (the experimental corner's, or another package's)
registers its config (``config.register_merge_method``) and its per-tensor rule
(``streaming.register_tensor_rule``) when imported; the merge config finds that module through the
entry-point group ``forgetless.merge_methods``, so this floor imports none of them by name.
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
