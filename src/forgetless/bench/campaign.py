"""Bench campaigns: a bench too long for one sitting, kept run by run in a folder (committed).

Each finished run leaves ``<folder>/<device>/<variant>/<run>.json``: its resolved config and the
config's key, the run's summary and raw ``results.json``, the commit and the machine. A bench
given the same folder skips every run whose record holds the same config key, so a campaign
resumes on a fresh clone; a record whose config differs is run again and replaced. Records of a
GPU machine sit apart from the CPU ones (``device``), so their figures never mix.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from forgetless.config.schema import RunConfig
from forgetless.core.machine import cpu_name, load_average
from forgetless.core.paths import read_stripped
from forgetless.core.storage import atomic_write_json

RECORD_VERSION = 1


_TAGS = frozenset({"name", "kind", "method"})
"""Fields kept even at their default: they say which method or scorer a block configures."""


def config_key(cfg: RunConfig) -> str:
    """What a run's figures depend on: every setting that differs from its default, and the
    name of each method and scorer.

    Defaults are left out so that an option added later (with a default that keeps the old
    behaviour) does not turn a campaign's kept runs stale.
    """
    text = json.dumps(essential_settings(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def essential_settings(value: Any) -> Any:
    """``value`` as JSON data, each pydantic model reduced to its non-default fields and tags."""
    if isinstance(value, BaseModel):
        out = {}
        for name, field in type(value).model_fields.items():
            item = getattr(value, name)
            if name in _TAGS or item != field.get_default(call_default_factory=True):
                out[name] = essential_settings(item)
        return out
    if isinstance(value, list | tuple):
        return [essential_settings(v) for v in value]
    if isinstance(value, dict):
        return {str(k): essential_settings(v) for k, v in value.items()}
    return to_jsonable_python(value)


def device_kind() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def record_path(folder: Path, variant_folder: str, run_folder: str) -> Path:
    return folder / device_kind() / variant_folder / f"{run_folder}.json"


def load_record(path: Path, key: str) -> dict[str, Any] | None:
    """The kept record when it exists and was made under the config ``key``; else None."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or record.get("config_key") != key:
        return None
    summary = record.get("summary")
    return record if isinstance(summary, dict) else None


def git_commit(start: Path | None = None) -> str | None:
    """The checked-out commit of the git work tree holding ``start`` (default: the current
    folder), read from ``.git`` itself (no subprocess); None outside one. A linked worktree
    (``git worktree add``) has a ``.git`` file naming its own git folder, whose refs live in
    the repository's common folder."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        git = folder / ".git"
        if git.is_dir():
            return _resolve_head(git, git)
        if git.is_file():
            own = _linked_git_dir(git)
            return _resolve_head(own, _common_dir(own)) if own is not None else None
    return None


def _linked_git_dir(dot_git: Path) -> Path | None:
    line = read_stripped(dot_git)
    if line is None or not line.startswith("gitdir: "):
        return None
    return (dot_git.parent / line[len("gitdir: ") :]).resolve()


def _common_dir(git: Path) -> Path:
    common = read_stripped(git / "commondir")
    return (git / common).resolve() if common is not None else git


def _resolve_head(git: Path, common: Path) -> str | None:
    try:
        head = (git / "HEAD").read_text(encoding="utf-8").strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        for folder in (git, common):
            if (folder / ref).is_file():
                return (folder / ref).read_text(encoding="utf-8").strip()
        for line in (common / "packed-refs").read_text(encoding="utf-8").splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return None


@functools.cache
def commit_at_start() -> str | None:
    """The commit checked out when this process first asked: a run's, read as it starts, not
    as it ends (a long campaign may outlive several commits)."""
    return git_commit()


def contention(load_at_start: float | None, threads: int | None = None) -> dict[str, Any]:
    """The load beside a run: at its start (other work only) and at its end (its own
    ``threads`` included, this process's by default). The cores were shared when other work
    held more than half a core at either end; cost ratios compare only runs where they were
    not."""
    threads = threads or torch.get_num_threads()
    end = load_average()
    busy_start = load_at_start is not None and load_at_start > 0.5
    busy_end = end is not None and end > threads + 0.5
    unknown = load_at_start is None or end is None
    return {
        "load_start": load_at_start,
        "load_end": end,
        "shared_cores": None
        if unknown and not (busy_start or busy_end)
        else busy_start or busy_end,
    }


def provenance(load_at_start: float | None = None, threads: int | None = None) -> dict[str, Any]:
    """The commit checked out (when the run started), the machine a run ran on, and the load
    beside it; ``threads``: the run's own, where another process ran it."""
    threads = threads or torch.get_num_threads()
    return {
        "commit": commit_at_start(),
        "contention": contention(load_at_start, threads),
        "machine": {
            "device": device_kind(),
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "threads": threads,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def save_record(
    path: Path,
    cfg: RunConfig,
    summary: dict[str, Any],
    results: dict[str, Any],
    load_at_start: float | None = None,
) -> None:
    """Keep a finished run. The load at its start and its threads are the run's own record
    (``runtime``), read where it ran, when the caller did not measure them."""
    runtime = results.get("runtime") or {}
    if load_at_start is None:
        load_at_start = runtime.get("load_at_start")
    record = {
        "record_version": RECORD_VERSION,
        "config_key": config_key(cfg),
        "config": cfg.model_dump(mode="json"),
        "summary": summary,
        "results": results,
        **provenance(load_at_start, runtime.get("threads")),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)
