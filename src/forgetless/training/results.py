"""The results file: accuracy matrix, probes, drift, per-task stats and metrics (schema in docs)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgetless.core.rundir import RunDir
from forgetless.core.storage import atomic_write_json
from forgetless.errors import CheckpointError
from forgetless.eval.evaluator import EvalRow
from forgetless.eval.metrics import average_forgetting, probe_retention_detail, summarize

SCHEMA_VERSION = 2


@dataclass
class Results:
    """Grows one row per finished task; row 0 is the model before any training."""

    config: dict[str, Any]
    tasks: list[str]
    probes: list[str]
    accuracy: list[list[float]] = field(default_factory=list)
    probe_accuracy: list[list[float]] = field(default_factory=list)
    kl_base_to_model: list[float | None] = field(default_factory=list)
    kl_model_to_base: list[float | None] = field(default_factory=list)
    per_task: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    probe_chance: list[float] = field(default_factory=list)
    probe_items: list[list[str]] = field(default_factory=list)
    """Per row, per probe: each question's outcome in order, "1" right and "0" wrong (empty for
    an lm-eval probe), so an interval can resample the items as well as the seeds."""
    loglik: list[list[float | None]] = field(default_factory=list)
    probe_loglik: list[list[float | None]] = field(default_factory=list)
    prose: list[dict[str, float]] = field(default_factory=list)
    """Per row: perplexity and KL(base || model) on the held-out prose (``eval.prose``)."""
    eval_seconds: list[float] = field(default_factory=list)
    """Per row: the wall time of its evaluation (a cached base row: the time to read it)."""
    eval_parts: list[dict[str, float]] = field(default_factory=list)
    """Per row: ``eval_seconds`` by part (``EvalRow.parts``; a cached base row: ``cache``)."""
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per data file the run reads: its size and SHA-256 (``training.inputs``)."""
    runtime: dict[str, Any] = field(default_factory=dict)
    """How the run computes: device, dtype, autocast, attention, gradient checkpointing
    (``training.startup.runtime``; empty in a file written before it was recorded)."""

    def add_row(self, row: EvalRow) -> None:
        """Append an evaluation of the model as it is now (``forgetless.eval.evaluator``)."""
        self.accuracy.append([row.accuracy[t] for t in self.tasks])
        self.probe_accuracy.append([row.accuracy[p] for p in self.probes])
        self.probe_chance = [row.chance[p] for p in self.probes]
        self.probe_items.append([_outcomes(row, p) for p in self.probes])
        if row.loglik:
            self.loglik.append([row.loglik[t] for t in self.tasks])
            self.probe_loglik.append([row.loglik.get(p) for p in self.probes])
        self.kl_base_to_model.append(row.kl_base_to_model)
        self.kl_model_to_base.append(row.kl_model_to_base)
        if row.prose is not None:
            self.prose.append(row.prose)
        self.eval_seconds.append(row.seconds)
        self.eval_parts.append(row.parts)

    @property
    def completed_tasks(self) -> int:
        return max(0, len(self.accuracy) - 1)

    def metrics(self) -> dict[str, Any]:
        """Metrics over the rows so far (a partial run is summarised over its finished tasks)."""
        done = self.completed_tasks
        if done == 0:
            return {}
        matrix = [row[:done] for row in self.accuracy]
        base_probes = self.probe_accuracy[0] if self.probe_accuracy else []
        now_probes = self.probe_accuracy[-1] if self.probe_accuracy else []
        chance = self.probe_chance or None
        out: dict[str, Any] = summarize(matrix, base_probes, now_probes, chance)
        since = self.config.get("eval", {}).get("forgetting", "any")
        out["forgetting"] = average_forgetting(matrix, since)
        out["forgetting_since"] = since
        if base_probes:
            detail = probe_retention_detail(self.probes, base_probes, now_probes, chance)
            out["probe_retention"] = {p.name: p.as_dict() for p in detail}
            out["warnings"] = [
                f"probe {p.name!r} scores {p.base:.2f} at the base, at or below chance "
                f"{p.chance:.2f}: left out of retention"
                for p in detail
                if p.retention is None
            ]
        if self.prose:
            out["prose"] = {
                "base_perplexity": self.prose[0]["perplexity"],
                "perplexity": self.prose[-1]["perplexity"],
                "kl_base_to_model": self.prose[-1]["kl_base_to_model"],
            }
        out["kl_drift"] = {
            "base_to_model": self.kl_base_to_model[-1],
            "model_to_base": self.kl_model_to_base[-1],
        }
        budgets = [t["budget"] for t in self.per_task if "budget" in t]
        if budgets:
            out["budget"] = {
                "kept_every_task": all(b["kept"] for b in budgets),
                "tasks_kept": sum(bool(b["kept"]) for b in budgets),
                "check_seconds": round(sum(b["seconds"] for b in budgets), 3),
                "end_value": budgets[-1]["end_value"],
            }
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "status": "complete" if self.completed_tasks == len(self.tasks) else "running",
            "completed_tasks": self.completed_tasks,
            "config": self.config,
            "tasks": self.tasks,
            "probes": self.probes,
            "rows": ["base"] + [f"after {t}" for t in self.tasks[: self.completed_tasks]],
            "accuracy_matrix": self.accuracy,
            "probe_accuracy": self.probe_accuracy,
            "kl_drift": {
                "base_to_model": self.kl_base_to_model,
                "model_to_base": self.kl_model_to_base,
            },
            "metrics": self.metrics(),
            "per_task": self.per_task,
            "events": self.events,
            "probe_chance": self.probe_chance,
            "probe_items": self.probe_items,
            "loglik": self.loglik,
            "probe_loglik": self.probe_loglik,
            "prose": self.prose,
            "eval_seconds": self.eval_seconds,
            "eval_parts": self.eval_parts,
            "inputs": self.inputs,
            "runtime": self.runtime,
        }

    def write(self, out_dir: Path) -> None:
        atomic_write_json(RunDir(out_dir).results, self.to_json())

    @classmethod
    def read(cls, path: Path) -> Results:
        """Read ``results.json``; a truncated, foreign or inconsistent file is a one-line error."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            why = getattr(err, "msg", None) or getattr(err, "strerror", None) or type(err).__name__
            raise CheckpointError(f"{path}: unreadable results file ({why})") from None
        _check_results(data, path)
        return cls(
            config=data["config"],
            tasks=data["tasks"],
            probes=data["probes"],
            accuracy=data["accuracy_matrix"],
            probe_accuracy=data["probe_accuracy"],
            kl_base_to_model=data["kl_drift"]["base_to_model"],
            kl_model_to_base=data["kl_drift"]["model_to_base"],
            per_task=data["per_task"],
            events=data.get("events", []),
            probe_chance=data.get("probe_chance", []),
            probe_items=data.get("probe_items", []),
            loglik=data.get("loglik", []),
            probe_loglik=data.get("probe_loglik", []),
            prose=data.get("prose", []),
            eval_seconds=data.get("eval_seconds", []),
            eval_parts=data.get("eval_parts", []),
            inputs=data.get("inputs", {}),
            runtime=data.get("runtime", {}),
        )


def _outcomes(row: EvalRow, probe: str) -> str:
    scored = row.results.get(probe)
    return "".join("1" if c else "0" for c in scored.correct) if scored is not None else ""


def _check_results(data: Any, path: Path) -> None:
    """Refuse a results file that this program did not write, or that does not hang together."""

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a forgetless results file ({why})")

    if not isinstance(data, dict):
        raise refuse(f"the top level is a {type(data).__name__}")
    kinds = {
        "config": dict,
        "tasks": list,
        "probes": list,
        "accuracy_matrix": list,
        "probe_accuracy": list,
        "kl_drift": dict,
        "per_task": list,
    }
    for key, kind in kinds.items():
        if not isinstance(data.get(key), kind):
            raise refuse(f"{key!r} is missing or not a {kind.__name__}")
    drift = data["kl_drift"]
    if not all(isinstance(drift.get(k), list) for k in ("base_to_model", "model_to_base")):
        raise refuse("'kl_drift' lacks its two lists")
    rows, width = data["accuracy_matrix"], len(data["tasks"])
    if len(rows) > width + 1 or any(not isinstance(r, list) or len(r) != width for r in rows):
        raise refuse(f"the accuracy matrix is not a list of rows of {width} tasks")
    n_probes = len(data["probes"])
    probe_rows = data["probe_accuracy"]
    if len(probe_rows) != len(rows) or any(
        not isinstance(r, list) or len(r) != n_probes for r in probe_rows
    ):
        raise refuse("the probe rows do not match the accuracy rows")
