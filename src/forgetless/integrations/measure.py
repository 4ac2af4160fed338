"""What a trainer logs of forgetting: retention of the probes and the KL to the base, both on a
small held-out probe batch, measured as a forgetless run's budget measures them.

Retention is ``probe_retention`` (docs/metrics.md): per probe above chance at the base,
``clip((now − c) / (base − c), 0, 1)``, averaged. The KL is the token ``KL(p_base ‖ p_model)``
over the probes' gold completions, teacher-forced (``forgetless.eval.generation.kl_drift``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from forgetless.eval.generation import forced_logprobs, kl_drift, teacher_forced_inputs
from forgetless.eval.metrics import probe_retention, probe_retention_unclipped
from forgetless.eval.scorers import chance_level
from forgetless.tasks.base import Task
from forgetless.tasks.builtin import build_builtin_task
from forgetless.training.budget_probe import probe_batch, probe_scorer

Logprobs = tuple[torch.Tensor, torch.Tensor]


def resolve_probes(probes: Sequence[Task | str], examples: int, seed: int) -> list[Task]:
    """Probe tasks: each a ``Task`` as given, or a built-in's name built with ``examples``
    training examples (the probe batch draws from the training split only)."""
    return [
        p if isinstance(p, Task) else build_builtin_task(p, n_train=examples, n_eval=1, seed=seed)
        for p in probes
    ]


class ProbeMeter:
    """Measures retention and KL to the base on the probe batch of ``probes`` (``size``
    examples shared out over them, drawn from their training split)."""

    def __init__(self, probes: list[Task], tokenizer: Any, max_length: int, size: int) -> None:
        self.batch = probe_batch(probes, size)
        self.scorers = [probe_scorer(tokenizer, p, max_length) for p in self.batch]
        self.inputs = [teacher_forced_inputs(tokenizer, p.eval, max_length) for p in self.batch]
        self.chance = [chance_level(p) for p in self.batch]
        self.base_scores: list[float] = []
        self.base_logprobs: list[Logprobs] = []

    def fix_base(self, model: nn.Module) -> None:
        """Take ``model`` as the base every later measure compares with."""
        self.base_scores = [score(model) for score in self.scorers]
        self.base_logprobs = [forced_logprobs(model, x) for x in self.inputs]

    def measure(self, model: nn.Module) -> dict[str, float]:
        """``retention`` and ``retention_unclipped`` (left out when no probe is above chance at
        the base), ``kl_to_base`` and each probe's accuracy, as ``acc/<probe>``."""
        if not self.base_logprobs:
            raise RuntimeError("ProbeMeter.measure before fix_base")
        scores = [score(model) for score in self.scorers]
        drift = [
            kl_drift(b, forced_logprobs(model, x))[0]
            for b, x in zip(self.base_logprobs, self.inputs, strict=True)
        ]
        out = {"kl_to_base": sum(drift) / len(drift)}
        kept = probe_retention(self.base_scores, scores, self.chance)
        unclipped = probe_retention_unclipped(self.base_scores, scores, self.chance)
        if kept is not None and unclipped is not None:
            out |= {"retention": kept, "retention_unclipped": unclipped}
        out.update({f"acc/{p.name}": s for p, s in zip(self.batch, scores, strict=True)})
        return out
