"""The base row, evaluated once and cached (``eval.cache_base_row``).

Row 0 of every run scores the untouched base on the run's tasks and probes; in a bench, every
method of a seed evaluates the same model on the same examples. With the cache on, the first
run stores the row under a key of everything it depends on (the model's files, the task and
probe configs, the evaluation settings, the seed, the token budget) and the others read it. On
the real-model track the full base evaluation takes minutes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from forgetless.config.schema import RunConfig
from forgetless.core.paths import cache_root
from forgetless.core.storage import atomic_write_json
from forgetless.training.results import Results

ROW_FIELDS = (
    "accuracy",
    "probe_accuracy",
    "loglik",
    "probe_loglik",
    "kl_base_to_model",
    "kl_model_to_base",
    "prose",
    "probe_items",
)
ROW_VERSION = 2


def _model_files(source: str) -> list[tuple[str, int, int]] | None:
    folder = Path(source)
    if not folder.is_dir():
        return None  # a hub id: its files are not ours to fingerprint
    return [
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.iterdir())
        if p.is_file()
    ]


def base_row_path(cfg: RunConfig, source: str) -> Path | None:
    """Where the base row of ``cfg`` on the model in ``source`` is cached (None: not cached)."""
    files = _model_files(source)
    if not cfg.eval.cache_base_row or files is None:
        return None
    payload = {
        "version": ROW_VERSION,
        "model": [str(Path(source).resolve()), files],
        "dtype": cfg.model.dtype,
        "tasks": [t.model_dump(mode="json") for t in cfg.tasks],
        "probes": [p.model_dump(mode="json") for p in cfg.probes],
        "eval": cfg.eval.model_dump(mode="json"),
        "seed": cfg.seed,
        "max_length": cfg.train.max_length,
    }
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "base-rows" / f"{key}.json"


def load_base_row(path: Path, results: Results) -> bool:
    """Append the cached row to ``results``; False when there is none (or it is unreadable)."""
    try:
        row = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(row, dict) or not all(k in row for k in (*ROW_FIELDS, "probe_chance")):
        return False
    for name in ROW_FIELDS:
        if row[name] is not None:
            getattr(results, name).append(row[name])
    results.probe_chance = row["probe_chance"]
    return True


def store_base_row(path: Path, results: Results) -> None:
    row: dict[str, Any] = {
        name: getattr(results, name)[0] if getattr(results, name) else None for name in ROW_FIELDS
    }
    row["probe_chance"] = results.probe_chance
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, row)
