"""``forgetless diagnose attribution``: task importance maps of a finished run and their overlap.

For each task ``t``, the map ``R_t`` is computed on the checkpoint after ``t`` from the task's
training samples the model answers correctly (``forgetless.attribution``). The paper's
mechanistic claim (Liu et al. 2026, arXiv:2605.05285, Fig. 1) is that after *sequential*
training the tasks' important sets overlap much more than after *independent* training of each
task from the base: the sequential overlap uses every task's map on the final checkpoint, the
independent one the final checkpoint of each one-task run passed with ``--independent``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from itertools import combinations
from pathlib import Path
from typing import Any

import torch
from torch import nn

from forgetless.attribution.importance import (
    MapAccumulator,
    jaccard,
    random_jaccard,
    top_set,
)
from forgetless.attribution.relevance import relevance_session
from forgetless.config.schema import RunConfig
from forgetless.core.ownership import check_output_file, write_output_file
from forgetless.tasks.base import Task
from forgetless.tasks.formatting import collate, encode_example
from forgetless.training.export import RunFolderError, checkpoint_model, load_run

Maps = dict[str, torch.Tensor]
_LAYER = re.compile(r"\.layers\.(\d+)\.")


AttributionRunError = RunFolderError
"""A run folder that cannot be diagnosed (kept as a name for callers of this module)."""


def layer_of(name: str) -> str:
    """``layer 3`` for a block's parameter, else ``other`` (embeddings, final norm, head)."""
    found = _LAYER.search(name)
    return f"layer {int(found.group(1))}" if found else "other"


def grouped_overlap(
    first: Maps, second: Maps, fraction: float, group: Callable[[str], str] = layer_of
) -> dict[str, float]:
    """Jaccard of the top-``fraction`` sets within each group of tensors, and ``overall``."""
    names = sorted(set(first) & set(second))
    if not names:
        raise ValueError("the two maps share no parameter")
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(group(name), []).append(name)
    groups["overall"] = names
    out = {}
    for label, members in groups.items():
        a = torch.cat([first[n].flatten().float() for n in members])
        b = torch.cat([second[n].flatten().float() for n in members])
        out[label] = jaccard(top_set(a, fraction), top_set(b, fraction))
    return out


def task_map(
    model: nn.Module, tokenizer: Any, task: Task, cfg: RunConfig, samples: int, top: float
) -> tuple[Maps, dict[str, Any]]:
    """``R_t`` from the task's correct training samples (all of them if none is correct)."""
    examples = task.train[:samples]
    feats = [encode_example(tokenizer, e, cfg.train.resolved_max_length) for e in examples]
    correct, every = MapAccumulator(top, True), MapAccumulator(top, True)
    start = time.perf_counter()
    with relevance_session(model) as score:
        for feat in feats:
            result = score(collate([feat], tokenizer.pad_token_id))
            normalized = every.normalize(result.relevance)  # once, for both means
            every.add_normalized(normalized)
            if result.correct:
                correct.add_normalized(normalized)
    seconds = (time.perf_counter() - start) / max(1, len(feats))
    chosen = correct if correct.count else every
    maps = chosen.mean()
    info = {
        "samples": len(feats),
        "correct": correct.count,
        "fallback_all_samples": not correct.count,
        "seconds_per_sample": seconds,
        **map_summary(maps),
    }
    return maps, info


def map_summary(maps: Maps) -> dict[str, Any]:
    """Mean importance and share above 0.5, overall and per layer."""
    per_layer: dict[str, list[torch.Tensor]] = {}
    for name, value in maps.items():
        per_layer.setdefault(layer_of(name), []).append(value.float().flatten())

    def stats(parts: list[torch.Tensor]) -> dict[str, float]:
        flat = torch.cat(parts)
        return {"mean": float(flat.mean()), "frac_above_half": float((flat > 0.5).float().mean())}

    everything = [p for parts in per_layer.values() for p in parts]
    return {
        "map": stats(everything),
        "per_layer": {k: stats(v) for k, v in sorted(per_layer.items())},
    }


def pairwise(maps: dict[str, Maps], top: float) -> list[dict[str, Any]]:
    return [
        {"tasks": [a, b], "jaccard": grouped_overlap(maps[a], maps[b], top)}
        for a, b in combinations(sorted(maps), 2)
    ]


def mean_overall(pairs: list[dict[str, Any]]) -> float | None:
    values = [p["jaccard"]["overall"] for p in pairs]
    return sum(values) / len(values) if values else None


def diagnose_attribution(
    run_dir: Path,
    independent: list[Path] | None = None,
    out: Path | None = None,
    samples: int = 32,
    top: float = 0.01,
    overlap_fraction: float = 0.05,
    same_model: bool = True,
) -> dict[str, Any]:
    """Per-task maps of ``run_dir``, the sequential overlap, and the independent one if given.

    ``same_model`` adds the control: every task's map on one model, the base
    (``same_model_base``) and each independent run's model (``same_model_independent``). The
    sequential maps all come from one model while the independent ones come from several, and
    ``R = θ ⊙ ∂θ`` shares ``|θ|`` within a model; overlap on one model that was never trained
    on the sequence says how much of the sequential overlap that alone explains.
    """
    target = out or run_dir / "attribution.json"
    check_output_file(target, "attribution", "attribution.json")
    cfg, results = load_run(run_dir)
    from forgetless.training.runner import load_tasks

    tasks = load_tasks(cfg.tasks, cfg)
    done = int(results.get("completed_tasks", 0))
    if done == 0:
        raise AttributionRunError(f"{run_dir}: no finished task")
    per_task, final_maps = [], {}
    names = [t.name for t in tasks]
    for index in range(1, done + 1):
        model, tokenizer = checkpoint_model(cfg, run_dir, names, index)
        maps, info = task_map(model, tokenizer, tasks[index - 1], cfg, samples, top)
        per_task.append({"task": names[index - 1], "after_task": index, **info})
        if index == done:
            final_maps[names[index - 1]] = maps
            for task in tasks[: done - 1]:
                final_maps[task.name] = task_map(model, tokenizer, task, cfg, samples, top)[0]
    data: dict[str, Any] = {
        "run": str(run_dir),
        "top_fraction": top,
        "overlap_fraction": overlap_fraction,
        "random_jaccard": random_jaccard(overlap_fraction),
        "per_task": per_task,
        "sequential": pairwise(final_maps, overlap_fraction),
    }
    data["sequential_mean"] = mean_overall(data["sequential"])
    if same_model:
        data.update(_same_model_control(cfg, run_dir, tasks[:done], independent, samples, top))
        data["same_model_base"] = pairwise(data.pop("base_maps"), overlap_fraction)
        data["same_model_base_mean"] = mean_overall(data["same_model_base"])
        per_model = [pairwise(m, overlap_fraction) for m in data.pop("independent_model_maps")]
        data["same_model_independent"] = [p for pairs in per_model for p in pairs]
        data["same_model_independent_mean"] = mean_overall(data["same_model_independent"])
    if independent:
        data["independent"] = pairwise(
            _independent_maps(independent, samples, top), overlap_fraction
        )
        data["independent_mean"] = mean_overall(data["independent"])
    write_output_file(target, "attribution", data)
    return data


def _same_model_control(
    cfg: RunConfig,
    run_dir: Path,
    tasks: list[Task],
    independent: list[Path] | None,
    samples: int,
    top: float,
) -> dict[str, Any]:
    """Every task's map on the base model, and on each independent run's final model."""
    base, tokenizer = checkpoint_model(cfg, run_dir, [t.name for t in tasks], 0)
    base_maps = {t.name: task_map(base, tokenizer, t, cfg, samples, top)[0] for t in tasks}
    models = []
    for other in independent or []:
        other_cfg, results = load_run(other)
        other_tasks = load_tasks_of(other_cfg)
        done = int(results.get("completed_tasks", 0))
        model, tok = checkpoint_model(other_cfg, other, [t.name for t in other_tasks], done)
        models.append({t.name: task_map(model, tok, t, cfg, samples, top)[0] for t in tasks})
    return {"base_maps": base_maps, "independent_model_maps": models}


def load_tasks_of(cfg: RunConfig) -> list[Task]:
    from forgetless.training.runner import load_tasks

    return load_tasks(cfg.tasks, cfg)


def _independent_maps(run_dirs: list[Path], samples: int, top: float) -> dict[str, Maps]:
    """Each run's last task's map on its own final checkpoint."""
    from forgetless.training.runner import load_tasks

    maps = {}
    for run_dir in run_dirs:
        cfg, results = load_run(run_dir)
        done = int(results.get("completed_tasks", 0))
        if done == 0:
            raise AttributionRunError(f"{run_dir}: no finished task")
        tasks = load_tasks(cfg.tasks, cfg)
        model, tokenizer = checkpoint_model(cfg, run_dir, [t.name for t in tasks], done)
        task = tasks[done - 1]
        maps[task.name] = task_map(model, tokenizer, task, cfg, samples, top)[0]
    return maps
