"""Score any model on tasks and probes, with or without a run: accuracy, probe retention,
log-likelihood, output-space KL and prose perplexity against a base, and lm-eval tasks.

    evaluator = Evaluator(probes, tokenizer)
    evaluator.measure_base(base_model)          # the reference for KL, prose and retention
    row = evaluator.score(model)
    row.retention(evaluator.base_row)           # per probe, above-chance ratio to the base
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from forgetless.config.evaluation import LmEvalProbe
from forgetless.config.schema import EvalConfig, RunConfig, probe_names
from forgetless.eval.generation import EvalResult, completion_logprobs, gold_loglik, kl_drift
from forgetless.eval.lm_eval_probe import lm_eval_outcome
from forgetless.eval.metrics import ProbeRetention, probe_retention_detail
from forgetless.eval.prose import ProseBase, encode_prose, prose_base, prose_row
from forgetless.eval.scorers import chance_level, score_task
from forgetless.tasks.base import Task
from forgetless.tasks.general import prose_paragraphs

Advance = Callable[[float | None], None]
ProgressBars = Callable[[str, int], AbstractContextManager[Advance]]
"""``bars(description, total)``: a context that yields an ``advance`` callable (a run's bars)."""


def _ignore(loss: float | None = None) -> None:
    return None


@contextmanager
def _silent(description: str, total: int) -> Iterator[Advance]:
    yield _ignore


class Stopwatch:
    """Seconds per named part: ``with clock("loglik"): ...`` adds to ``clock.parts["loglik"]``."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = self.parts.get(name, 0.0) + time.perf_counter() - start
            self.parts[name] = round(spent, 3)


@dataclass
class EvalRow:
    """One model's scores. ``accuracy`` names every task, then every probe (task and lm-eval);
    ``chance`` and ``loglik`` name the probes (and, for loglik, the tasks)."""

    accuracy: dict[str, float]
    chance: dict[str, float]
    loglik: dict[str, float | None] = field(default_factory=dict)
    kl_base_to_model: float | None = None
    kl_model_to_base: float | None = None
    prose: dict[str, float] | None = None
    seconds: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per part of ``seconds``: each task and probe by name, then ``lm_eval``,
    ``loglik``, ``kl_drift`` and ``prose`` (where the evaluation's time goes)."""
    results: dict[str, EvalResult] = field(default_factory=dict, repr=False)
    """The task and task-probe scorings behind ``accuracy`` (what a method's task end reads)."""

    def retention(self, base: EvalRow) -> dict[str, ProbeRetention]:
        """Per probe: the above-chance share of the base's score kept (docs/metrics.md)."""
        names = list(self.chance)
        detail = probe_retention_detail(
            names,
            [base.accuracy[n] for n in names],
            [self.accuracy[n] for n in names],
            [self.chance[n] for n in names],
        )
        return {d.name: d for d in detail}


class Evaluator:
    """Scores models on ``tasks`` and ``probes`` (built-in, JSONL or HF tasks) and lm-eval probes.

    ``measure_base`` fixes the reference model: its probe log-probs (for output-space KL) and its
    prose perplexity; ``score`` then measures any model against it. Settings are ``EvalConfig``'s
    (batch size, KL and log-likelihood examples, prose) and ``max_length``.
    """

    def __init__(
        self,
        probes: Sequence[Task],
        tokenizer: Any,
        *,
        tasks: Sequence[Task] = (),
        lm_probes: Sequence[LmEvalProbe] = (),
        settings: EvalConfig | None = None,
        max_length: int = 64,
        probe_order: Sequence[str] | None = None,
    ) -> None:
        self.tasks, self.probes, self.lm_probes = list(tasks), list(probes), list(lm_probes)
        self.tokenizer, self.max_length = tokenizer, max_length
        self.settings = settings or EvalConfig()
        lm_names = [name for p in self.lm_probes for name in p.names]
        self.probe_names = list(probe_order or [p.name for p in self.probes] + lm_names)
        self.base_logprobs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.prose: tuple[list[torch.Tensor], ProseBase] | None = None
        self.base_row: EvalRow | None = None
        self.lm_chance: dict[str, float] = {}
        """lm-eval probes' chance scores, measured from their documents on the first scoring."""

    @classmethod
    def for_run(
        cls, cfg: RunConfig, tasks: Sequence[Task], probes: Sequence[Task], tokenizer: Any
    ) -> Evaluator:
        """The evaluator of a run of ``cfg``: its tasks, its task probes and lm-eval probes."""
        return cls(
            probes,
            tokenizer,
            tasks=tasks,
            lm_probes=[p for p in cfg.probes if isinstance(p, LmEvalProbe)],
            settings=cfg.eval,
            max_length=cfg.train.resolved_max_length,
            probe_order=probe_names(cfg.probes),
        )

    def measure_base(self, model: nn.Module, score: bool = False) -> None:
        """Fix ``model`` as the base: KL's reference log-probs and prose; ``score`` also scores
        it as ``base_row`` (the reference of ``EvalRow.retention``)."""
        if self.settings.kl_drift and self.probes:
            self.base_logprobs = self._probe_logprobs(model)
        if self.settings.prose:
            paragraphs = prose_paragraphs()[: self.settings.prose_paragraphs]
            chunks = encode_prose(self.tokenizer, paragraphs, self.settings.prose_max_tokens)
            self.prose = chunks, prose_base(model, chunks, self.settings.prose_kl_paragraphs)
        if score:
            self.base_row = self.score(model, base=True)

    def score(
        self,
        model: nn.Module,
        between: bool = False,
        base: bool = False,
        bars: ProgressBars = _silent,
    ) -> EvalRow:
        """Score ``model``; ``between`` caps the examples at ``eval.between`` (a row between
        tasks); ``base`` says it is the base itself (its prose row is the one measured)."""
        start, clock = time.perf_counter(), Stopwatch()
        cap = self.settings.between if between else None
        results = self._scored(model, cap, bars, clock)
        accuracy = {name: r.accuracy for name, r in results.items()}
        with clock("lm_eval"):
            accuracy.update(self._lm_eval_scores(model))
        row = EvalRow(accuracy, self.chance(), results=results)
        with clock("loglik"):
            row.loglik = self._loglik(model)
        with clock("kl_drift"):
            row.kl_base_to_model, row.kl_model_to_base = self._drift(model)
        with clock("prose"):
            row.prose = self._prose_row(model, between, base)
        row.seconds, row.parts = round(time.perf_counter() - start, 2), clock.parts
        return row

    def chance(self) -> dict[str, float]:
        """Each probe's chance score (0 where answers are free text; an lm-eval probe's is its
        setting, else 1/choices once measured)."""
        chance = {p.name: chance_level(p) for p in self.probes}
        for probe in self.lm_probes:
            for name in probe.names:
                chance[name] = (
                    probe.lm_eval.chance
                    if probe.lm_eval.chance is not None
                    else self.lm_chance.get(name, 0.0)
                )
        return {name: chance[name] for name in self.probe_names}

    def _scored(
        self, model: nn.Module, cap: int | None, bars: ProgressBars, clock: Stopwatch
    ) -> dict[str, Any]:
        everything = [*self.tasks, *self.probes]
        out = {}
        with bars("evaluate", len(everything)) as advance:
            for task in everything:
                shown = task if cap is None else dataclasses.replace(task, eval=task.eval[:cap])
                with clock(task.name):
                    out[task.name] = score_task(
                        model, self.tokenizer, shown, self.settings.batch_size
                    )
                advance(None)
        return out

    def _lm_eval_scores(self, model: nn.Module) -> dict[str, float]:
        scores: dict[str, float] = {}
        for probe in self.lm_probes:
            batch = self.settings.batch_size
            unknown = probe.lm_eval.chance is None and not set(probe.names) <= set(self.lm_chance)
            outcome = lm_eval_outcome(model, self.tokenizer, probe.lm_eval, batch, unknown)
            scores.update(outcome.scores)
            self.lm_chance.update(outcome.chance)
        return scores

    def _probe_logprobs(self, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = self.settings.kl_examples
        return [
            completion_logprobs(model, self.tokenizer, p.eval[:n], self.max_length)
            for p in self.probes
        ]

    def _drift(self, model: nn.Module) -> tuple[float | None, float | None]:
        """Mean KL(base ‖ model) and KL(model ‖ base) over the task probes' completions."""
        if self.base_logprobs is None:
            return None, None
        now = self._probe_logprobs(model)
        pairs = [kl_drift(b, n) for b, n in zip(self.base_logprobs, now, strict=True)]
        return float(np.mean([p[0] for p in pairs])), float(np.mean([p[1] for p in pairs]))

    def _loglik(self, model: nn.Module) -> dict[str, float | None]:
        """The gold completions' mean log-likelihood per task and task probe (lm-eval: None)."""
        n = self.settings.loglik_examples
        if n == 0:
            return {}

        def of(task: Task) -> float:
            examples = task.eval[:n]
            batch = self.settings.batch_size
            return gold_loglik(model, self.tokenizer, examples, self.max_length, batch)

        scores: dict[str, float | None] = {t.name: of(t) for t in [*self.tasks, *self.probes]}
        return {**scores, **{n: scores.get(n) for n in self.probe_names}}

    def _prose_row(self, model: nn.Module, between: bool, base: bool) -> dict[str, float] | None:
        if self.prose is None:
            return None
        chunks, measured = self.prose
        if base:
            return measured.as_row()
        shown = chunks[: self.settings.prose_kl_paragraphs] if between else chunks
        return prose_row(model, shown, measured)
