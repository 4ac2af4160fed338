"""The data files a run reads, and their fingerprints: a resume must read what the run began on."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from forgetless.config.evaluation import LmEvalProbe
from forgetless.config.schema import RunConfig, TaskConfig, task_places
from forgetless.errors import ConfigError

Fingerprint = dict[str, Any]
CHUNK = 1 << 20


def _task_files(task: TaskConfig) -> list[Path]:
    if task.jsonl is not None:
        local = [task.jsonl.train] + ([task.jsonl.eval] if task.jsonl.eval else [])
    elif task.hf is not None:
        named = task.hf.data_files
        names = (
            [named]
            if isinstance(named, str)
            else list(named.values() if isinstance(named, dict) else named or [])
        )
        local = [Path(task.hf.path), *map(Path, names)]
    else:
        local = []
    return [p for p in local if p.exists()]


def data_files(cfg: RunConfig) -> list[Path]:
    """Every local file or dataset folder the tasks and task probes read, in config order."""
    tasks = [task for _, _, task in task_places(cfg)]
    seen: dict[str, Path] = {}
    for task in tasks:
        for path in _task_files(task):
            seen.setdefault(str(path), path)
    return list(seen.values())


def _hash_into(digest: Any, path: Path) -> int:
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size


def fingerprint(path: Path) -> Fingerprint:
    """Size and SHA-256 of a file, or of a folder's files (names and contents, in order)."""
    digest = hashlib.sha256()
    if path.is_file():
        return {"size": _hash_into(digest, path), "sha256": digest.hexdigest()}
    size = 0
    for inner in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(inner.relative_to(path)).encode())
        size += _hash_into(digest, inner)
    return {"size": size, "sha256": digest.hexdigest()}


def fingerprints(cfg: RunConfig) -> dict[str, Fingerprint]:
    return {str(path): fingerprint(path) for path in data_files(cfg)}


def changed_inputs(before: dict[str, Fingerprint], now: dict[str, Fingerprint]) -> list[str]:
    """The files whose fingerprint differs, or that one side lacks (an older run records none)."""
    if not before:
        return []
    return sorted(p for p in set(before) | set(now) if before.get(p) != now.get(p))


def check_local_inputs(cfg: RunConfig) -> None:
    """Read what ``run`` would read of the local inputs, offline and without the model's
    weights: every JSONL task and probe, every dataset on local files, and the model folder or
    GGUF file. A hub id (model or dataset) is left to ``run``, which may download it. Raises
    the loaders' one-line error, prefixed with the config's place."""
    from forgetless.errors import ForgetlessError
    from forgetless.tasks.loaders import build_task, reads_local_files

    model = cfg.model.name_or_path
    if model is not None:
        _check_local_model(str(model))
    for section, index, task in task_places(cfg):
        if not reads_local_files(task):
            continue
        try:
            build_task(task, cfg.eval, cfg.seed, probe=section == "probes")
        except ForgetlessError as err:
            raise type(err)(f"{section}.{index}: {err}") from None
    check_lm_eval_probes(cfg)


def check_lm_eval_probes(cfg: RunConfig) -> None:
    """Every lm-eval probe's tasks are ones lm-eval knows (its index is kept for the scoring).
    Raises a one-line ConfigError prefixed with the probe's place."""
    from forgetless.eval.lm_eval_probe import check_lm_eval_tasks

    for index, probe in enumerate(cfg.probes):
        if isinstance(probe, LmEvalProbe):
            try:
                check_lm_eval_tasks(probe.lm_eval)
            except ConfigError as err:
                raise ConfigError(f"probes.{index}: {err}") from None


def _check_local_model(name: str) -> None:
    """A GGUF file or a model folder named by path must be there (a packaged model is converted
    on first use; a hub id is run's to fetch)."""
    from forgetless.models.gguf import PACKAGED_MODELS, gguf_file
    from forgetless.models.loading import looks_local, resolve_source

    if name in PACKAGED_MODELS:
        return
    if name.endswith(".gguf"):
        gguf_file(name)
    elif looks_local(name):
        resolve_source(name)
