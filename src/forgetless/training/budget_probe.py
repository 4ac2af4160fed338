"""What a forgetting budget measures: its held-out probe batch during training, and the full
evaluation probes at the end of each task (``forgetless.engine.budget`` steers the knob)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from typing import Any

from torch import nn

from forgetless.config.budget import BudgetConfig
from forgetless.contract.method import Method
from forgetless.engine.budget import BudgetMonitor, budget_miss_line, budget_unlearned_line
from forgetless.errors import ConfigError
from forgetless.eval.generation import (
    forced_logprobs,
    forced_match,
    kl_drift,
    teacher_forced_inputs,
)
from forgetless.eval.metrics import probe_retention
from forgetless.eval.scorers import chance_level, score_task
from forgetless.tasks.base import Task, exact_match


def probe_batch(probes: list[Task], size: int) -> list[Task]:
    """Each probe with held-out examples, with ``size`` examples shared out over them as its
    evaluation set, drawn from its training split: never the examples the evaluation rows
    score. A probe whose whole set is its evaluation (no training split) is left out."""
    usable = [p for p in probes if p.train]
    if not usable:
        raise ConfigError(
            "budget.probe_batch: no probe has training examples to draw the probe batch from "
            "(the evaluation examples are never used)"
        )
    per_probe = math.ceil(size / len(usable))
    short = [p.name for p in usable if len(p.train) < per_probe]
    if short:
        raise ConfigError(
            f"budget.probe_batch: probe {short[0]!r} has fewer than {per_probe} training "
            "examples to draw the probe batch from"
        )
    return [dataclasses.replace(p, eval=p.train[:per_probe]) for p in usable]


def left_out(probes: list[Task]) -> list[str]:
    """The probes the probe batch cannot draw from (no held-out examples)."""
    return [p.name for p in probes if not p.train]


def budget_measure(
    cfg: BudgetConfig, base: nn.Module, tokenizer: Any, probes: list[Task], max_length: int
) -> Callable[[nn.Module], float]:
    """The budget's loss on the probe batch, measured against ``base`` (called now, on the
    base model): one minus the retention above chance, or the token KL to the base."""
    batch = probe_batch(probes, cfg.probe_batch)
    if cfg.metric == "kl_to_base":
        inputs = [teacher_forced_inputs(tokenizer, p.eval, max_length) for p in batch]
        reference = [forced_logprobs(base, x) for x in inputs]

        def kl(model: nn.Module) -> float:
            pairs = [
                kl_drift(b, forced_logprobs(model, x))[0]
                for b, x in zip(reference, inputs, strict=True)
            ]
            return sum(pairs) / len(pairs)

        return kl

    scorers = [probe_scorer(tokenizer, p, max_length) for p in batch]

    def scores(model: nn.Module) -> list[float]:
        return [score(model) for score in scorers]

    base_scores = scores(base)
    chance = [chance_level(p) for p in batch]
    if probe_retention(base_scores, base_scores, chance) is None:
        raise ConfigError(
            "budget: no probe scores above chance on the probe batch at the base: "
            "nothing for the budget to keep"
        )
    sizes = [len(p.eval) for p in batch]
    z = statistics.NormalDist().inv_cdf(cfg.confidence)

    def retention_loss(model: nn.Module) -> float:
        now = scores(model)
        kept = probe_retention(base_scores, now, chance)
        loss = 1.0 - (kept if kept is not None else 1.0)
        return min(1.0, loss + z * retention_standard_error(base_scores, now, chance, sizes))

    return retention_loss


def retention_standard_error(
    base: list[float], now: list[float], chance: list[float], sizes: list[int]
) -> float:
    """The binomial standard error of the probe-batch retention (``probe_retention``'s mean of
    ``(now − c) / (base − c)`` over the probes above chance), the base taken as exact."""
    terms = [
        n * (1 - n) / size / (b - c) ** 2
        for b, n, c, size in zip(base, now, chance, sizes, strict=True)
        if b > c
    ]
    return math.sqrt(sum(terms)) / len(terms) if terms else 0.0


def probe_scorer(tokenizer: Any, probe: Task, max_length: int) -> Callable[[nn.Module], float]:
    """The probe's accuracy on its batch, as a function of the model: for exact match,
    teacher-forced (one forward pass over the batch, encoded once here; the same verdict as
    greedy decoding but for another spelling the scorer would accept); for any other scorer,
    the scorer itself."""
    exact = probe.scoring is None or probe.scoring.kind == "exact_match"
    if exact and probe.scorer is exact_match:
        inputs = teacher_forced_inputs(tokenizer, probe.eval, max_length)

        def forced(model: nn.Module) -> float:
            hits = forced_match(model, inputs)
            return sum(hits) / len(hits)

        return forced
    return lambda model: score_task(model, tokenizer, probe, len(probe.eval)).accuracy


def full_probe_loss(cfg: BudgetConfig, results: Any) -> float | None:
    """The budget's loss on the full evaluation probes of the latest row (None: not measured)."""
    if cfg.metric == "kl_to_base":
        value = results.kl_base_to_model[-1]
        return None if value is None else float(value)
    kept = probe_retention(
        results.probe_accuracy[0], results.probe_accuracy[-1], results.probe_chance or None
    )
    return None if kept is None else 1.0 - kept


def start_monitor(
    budget: BudgetConfig,
    method: Method,
    measure: Callable[[nn.Module], float],
    probes: list[Task],
    results: Any,
    say: Callable[[str], None],
) -> BudgetMonitor:
    """The budget's monitor over ``measure`` (taken on the base); a resumed run goes on with the
    knob where its last task left it."""
    if skipped := left_out(probes):
        say(
            f"budget: the probe batch leaves out {', '.join(skipped)} (no held-out examples; "
            "the full evaluation at each task's end covers every probe)"
        )
    monitor = BudgetMonitor(budget, method, measure)
    done = [t["budget"]["end_value"] for t in results.per_task if "budget" in t]
    if done:
        monitor.value = done[-1]
        method.set_knob(done[-1])
    return monitor


def budget_row(
    budget: BudgetConfig,
    monitor: BudgetMonitor,
    task: str,
    results: Any,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The task's budget trace, and whether the full evaluation probes kept the budget; a
    budget not kept is said in one line and recorded as an event, with the best found."""
    summary = monitor.summary()
    loss = full_probe_loss(budget, results)
    kept = loss is None or loss <= budget.max_loss
    summary.update(metric=budget.metric, max_loss=budget.max_loss, loss_full=loss, kept=kept)
    line, action = "", ""
    if not kept:
        line = budget_miss_line(task, budget.metric, budget.max_loss, loss, monitor)
        action = "not_kept"
    elif monitor.nothing_kept():
        line = budget_unlearned_line(task, budget.metric, budget.max_loss, monitor)
        action = "not_learned"
    if line:
        say(f"warning: {line}")
        results.events.append({"type": "budget", "action": action, "task": task})
        summary["warning"] = line
    return {"budget": summary}
