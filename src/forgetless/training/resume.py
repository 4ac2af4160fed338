"""Whether an output folder may be resumed by a config, decided before anything is written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from forgetless.config.schema import RunConfig, probe_names
from forgetless.core.rundir import RunDir
from forgetless.errors import CheckpointError, ConfigError
from forgetless.training.inputs import Fingerprint, changed_inputs
from forgetless.training.results import Results

FIXED_ONCE_TRAINED = (
    "model.name_or_path",
    "model.revision",
    "model.tiny",
    "model.pretrain",
    "finetune",
    "method.name",
)
"""Config paths that the finished tasks' checkpoints depend on: never changed on resume (a
method's state belongs to its method, so another method cannot go on from it)."""


@dataclass(frozen=True)
class Remedies:
    """How a refusal names the ways out: the CLI's flags, or the Python API's arguments."""

    other_out: str = "another --out"
    allow: str = "--allow-config-change"


API_REMEDIES = Remedies(other_out="another out_dir", allow="allow_config_change=True")


def config_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths at which two resolved configs differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [
            d for k in keys for d in config_differences(old.get(k), new.get(k), f"{prefix}{k}.")
        ]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [
            d
            for i, (a, b) in enumerate(zip(old, new, strict=True))
            for d in config_differences(a, b, f"{prefix}{i}.")
        ]
    return [] if old == new else [prefix.rstrip(".")]


def read_stored_config(path: Path) -> dict[str, Any]:
    """A run folder's ``config.yaml``: a mapping, or a one-line error naming the file."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: unreadable stored config ({first})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: the stored config is not a mapping; remove it to restart")
    return data


def has_trained(out_dir: Path, results: Results | None) -> bool:
    """A finished task, or a task's step checkpoint: something a config change could corrupt."""
    if results is not None and results.completed_tasks > 0:
        return True
    return RunDir(out_dir).has_step_checkpoints()


def folder_has_trained(out_dir: Path) -> bool:
    """Whether the run in ``out_dir`` has trained anything (its results read when present)."""
    results = RunDir(out_dir).results
    return has_trained(out_dir, Results.read(results) if results.is_file() else None)


def resume_check(
    out_dir: Path,
    cfg: RunConfig,
    allow_change: bool,
    inputs: dict[str, Fingerprint] | None = None,
    remedies: Remedies = Remedies(),
) -> Results | None:
    """The stored results that ``cfg`` goes on from, or None for a fresh start.

    A folder with nothing trained in it is started afresh, whatever config it holds (a failed
    run's ``config.yaml`` does not block the corrected one). Otherwise the stored config
    (``config.yaml``, or the copy inside ``results.json`` when that file is gone) must equal
    ``cfg``, and the data files (``inputs``, their fingerprints now) must be the ones the run
    began on; ``allow_change`` lets either differ, recorded as an event in the results, except
    where the trained checkpoints or the results' columns depend on it. Raises before anything
    is written.
    """
    run = RunDir(out_dir)
    results_path, config_path = run.results, run.config
    stored = Results.read(results_path) if results_path.is_file() else None
    resolved = cfg.model_dump(mode="json")
    if not has_trained(out_dir, stored):
        if stored is None or config_differences(stored.config, resolved):
            return None
        return None if changed_inputs(stored.inputs, inputs or {}) else stored
    previous = read_stored_config(config_path) if config_path.is_file() else None
    if previous is None and stored is not None:
        previous, config_path = stored.config, results_path
    if previous is None:
        return None
    changed = config_differences(previous, resolved)
    if changed and not allow_change:
        raise ConfigError(
            f"{config_path}: stored config differs at {', '.join(changed)}; "
            f"use {remedies.other_out} or {remedies.allow}"
        )
    fixed = [c for c in changed if _fixed(c)]
    if fixed:
        why = (
            "the method's state belongs to its method"
            if fixed[0] == "method.name"
            else "the checkpoints depend on it"
        )
        raise ConfigError(
            f"{config_path}: {remedies.allow} cannot change {fixed[0]} once a task has "
            f"trained ({why}); use {remedies.other_out}"
        )
    if stored is not None:
        _check_columns(results_path, stored, cfg, remedies)
        _check_inputs(results_path, stored, inputs or {}, allow_change, remedies)
        if changed:
            stored.events.append(_event("config_changed", stored, fields=changed))
    return stored


def _event(kind: str, stored: Results, **detail: Any) -> dict[str, Any]:
    return {"type": kind, "after_task": stored.completed_tasks, **detail}


def _check_inputs(
    path: Path,
    stored: Results,
    now: dict[str, Fingerprint],
    allow_change: bool,
    remedies: Remedies,
) -> None:
    """The data files must be the ones the run began on, unless ``allow_change`` (recorded)."""
    changed = changed_inputs(stored.inputs, now)
    if not changed:
        return
    if not allow_change:
        raise ConfigError(
            f"{changed[0]}: changed since the run in {path.parent} began (size or content "
            f"differs); a resumed run would mix two data sets: restore the file, use "
            f"{remedies.other_out}, or {remedies.allow} to go on and record it"
        )
    for name in changed:
        before, after = stored.inputs.get(name), now.get(name)
        stored.events.append(_event("input_changed", stored, file=name, before=before, after=after))


def _fixed(path: str) -> bool:
    return any(path == f or path.startswith(f"{f}.") for f in FIXED_ONCE_TRAINED)


def _check_columns(path: Path, stored: Results, cfg: RunConfig, remedies: Remedies) -> None:
    """The task sequence and probes name the results' columns: they cannot change on resume."""
    tasks, probes = [t.display_name for t in cfg.tasks], probe_names(cfg.probes)
    if stored.tasks != tasks:
        raise ConfigError(
            f"{path}: the run's tasks are {', '.join(stored.tasks)}; a resumed run cannot change "
            f"them to {', '.join(tasks)}; use {remedies.other_out}"
        )
    if stored.probes != probes:
        raise ConfigError(
            f"{path}: the run's probes are {', '.join(stored.probes) or 'none'}; a resumed run "
            f"cannot change them to {', '.join(probes) or 'none'}; use {remedies.other_out}"
        )
