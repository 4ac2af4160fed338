"""Papers that several methods cite, written once: each method's declaration names its paper,
inline where it is the only one to cite it."""

from __future__ import annotations

from forgetless.contract.method import Paper

ANCHORED_LEARNING = Paper(
    "Stabilizing LLM Supervised Fine-Tuning via Explicit Distributional Control"
)
"""Anchored Learning (summary in shared/papers/002): the ``anchored`` method and its baselines
``kl_sft`` and ``low_lr``."""
