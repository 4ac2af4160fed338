"""lm-evaluation-harness as a retention probe, on the in-memory model.

The current model (full, or the base model with its LoRA layers injected) is wrapped in
lm-eval's ``HFLM`` and evaluated with ``lm_eval.simple_evaluate`` (EleutherAI
lm-evaluation-harness, https://github.com/EleutherAI/lm-evaluation-harness, v0.4.13). lm-eval
is an optional extra (``pip install 'forgetless[lmeval]'``) imported only when a probe runs.
"""

from __future__ import annotations

import difflib
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from forgetless.config.evaluation import LMEVAL_PREFIX, LmEvalSettings
from forgetless.errors import ConfigError

PREFERRED_METRICS = ("acc_norm", "acc", "exact_match")
MISSING_EXTRA = (
    "lm-eval probes need lm-evaluation-harness: pip install 'forgetless[lmeval]' "
    "(or lm_eval==0.4.13)"
)


def pick_metric(task_results: Mapping[str, Any], metric: str | None, task: str) -> float:
    """One number from lm-eval's per-task results (keys such as ``"acc_norm,none"``).

    ``metric`` names it (with or without the ``,filter`` suffix); None takes the first of
    acc_norm, acc, exact_match that the task reports.
    """
    values = {
        key: float(value)
        for key, value in task_results.items()
        if "," in key and "_stderr" not in key and isinstance(value, int | float)
    }
    wanted = [metric] if metric is not None else list(PREFERRED_METRICS)
    for name in wanted:
        hits = [key for key in values if key == name or key.split(",", 1)[0] == name]
        if hits:
            return values[sorted(hits)[0]]
    known = ", ".join(sorted(values)) or "none"
    raise ConfigError(f"lm-eval task {task!r} reports no metric {' or '.join(wanted)}; has {known}")


@functools.lru_cache(maxsize=8)
def _task_index(include: str | None, include_defaults: bool) -> Any:
    """lm-eval's index of its tasks, seconds to build: built once per process and place, and
    handed to every scoring of the run instead of being built again for each."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include, include_defaults=include_defaults)


def task_manager(settings: LmEvalSettings) -> Any:
    """The lm-eval task index of a probe's ``include_path`` and ``include_defaults``."""
    try:
        import lm_eval.tasks  # noqa: F401
    except ImportError:
        raise ConfigError(MISSING_EXTRA) from None
    include = str(settings.include_path) if settings.include_path is not None else None
    return _task_index(include, settings.include_defaults)


def check_lm_eval_tasks(settings: LmEvalSettings) -> None:
    """Every task a probe names is one lm-eval knows (a task, group or tag in its index, or a
    task YAML file), so that a misspelt name stops a run before it writes anything."""
    folder = settings.include_path
    if folder is not None and not folder.is_dir():
        raise ConfigError(f"lm_eval.include_path: {folder} is not a folder")
    known = task_manager(settings).all_tasks
    for name in settings.tasks:
        if name in known or Path(name).is_file():
            continue
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"lm_eval.tasks: lm-eval has no task {name!r}{hint}; `lm-eval ls tasks` lists them"
        )


def _unwrap(model: nn.Module) -> nn.Module:
    """PEFT injects LoRA layers into the base model in place, so its base model runs them."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def choice_chance(output_type: str | None, samples: Sequence[Mapping[str, Any]]) -> float:
    """A task's chance score: the mean of 1/choices over its documents for multiple choice (one
    loglikelihood request per choice), 0 for free-text answers."""
    counts = [len(s.get("arguments") or ()) for s in samples]
    counts = [n for n in counts if n > 0]
    if output_type != "multiple_choice" or not counts:
        return 0.0
    return sum(1 / n for n in counts) / len(counts)


@dataclass(frozen=True)
class LmEvalOutcome:
    """One probe's scores, keyed ``lmeval:<task>``, and (when measured) each task's chance."""

    scores: dict[str, float]
    chance: dict[str, float] = field(default_factory=dict)


def run_lm_eval_probe(
    model: nn.Module, tokenizer: Any, settings: LmEvalSettings, batch_size: int
) -> dict[str, float]:
    """Scores of ``model`` on the lm-eval tasks of one probe, keyed ``lmeval:<task>``."""
    return lm_eval_outcome(model, tokenizer, settings, batch_size).scores


def lm_eval_outcome(
    model: nn.Module,
    tokenizer: Any,
    settings: LmEvalSettings,
    batch_size: int,
    measure_chance: bool = False,
) -> LmEvalOutcome:
    """``run_lm_eval_probe``'s scores; ``measure_chance`` also reads each task's chance from its
    documents' choices (lm-eval then keeps its samples, so it is asked once per run)."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        raise ConfigError(MISSING_EXTRA) from None
    was_training = model.training
    lm_logger = logging.getLogger("lm_eval")
    old_level = lm_logger.level
    lm_logger.setLevel(logging.ERROR)  # e.g. its warning about being handed a model object
    try:
        lm = HFLM(
            pretrained=_unwrap(model),
            tokenizer=tokenizer,
            batch_size=settings.batch_size or batch_size,
        )
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(settings.tasks),
            num_fewshot=settings.num_fewshot,
            limit=settings.limit,
            task_manager=task_manager(settings),
            apply_chat_template=settings.apply_chat_template,
            log_samples=measure_chance,
            bootstrap_iters=0,
            verbosity="ERROR",
        )
    except (KeyError, ValueError, FileNotFoundError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"lm-eval probe {settings.tasks}: {first}") from None
    finally:
        model.train(was_training)
        lm_logger.setLevel(old_level)
    if out is None:
        raise ConfigError(f"lm-eval probe {settings.tasks}: lm-eval returned no results")
    results = out["results"]
    scores = {
        f"{LMEVAL_PREFIX}{task}": pick_metric(results.get(task, {}), settings.metric, task)
        for task in settings.tasks
    }
    if not measure_chance:
        return LmEvalOutcome(scores)
    configs, samples = out.get("configs", {}), out.get("samples", {})
    chance = {
        f"{LMEVAL_PREFIX}{task}": choice_chance(
            configs.get(task, {}).get("output_type"), samples.get(task, [])
        )
        for task in settings.tasks
    }
    return LmEvalOutcome(scores, chance)
