"""Atomic writes (temp name + rename); method state as safetensors plus JSON."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:  # the methods package imports its methods, which import this module
    from forgetless.methods.base import MethodState

TENSORS_FILE = "method_state.safetensors"
META_FILE = "method_state.json"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, allow_nan=True) + "\n")


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp folder beside ``final``; on success it replaces ``final`` in one rename."""
    tmp = final.with_name(f".tmp-{final.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)


def _split_state(state: MethodState, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    meta: dict[str, Any] = {}
    for key, value in state.items():
        if "/" in key:
            raise ValueError(f"method state key {key!r} must not contain '/'")
        path = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            tensors[path] = value.detach().cpu().contiguous()
            meta[key] = {"__tensor__": path}
        elif isinstance(value, dict):
            meta[key] = _split_state(value, f"{path}/", tensors)
        else:
            meta[key] = value
    return meta


def _join_state(meta: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(meta, dict):
        if set(meta) == {"__tensor__"}:
            return tensors[meta["__tensor__"]]
        return {k: _join_state(v, tensors) for k, v in meta.items()}
    return meta


def save_method_state(folder: Path, state: MethodState) -> None:
    """Tensors go to safetensors, everything else to JSON (never pickle)."""
    tensors: dict[str, torch.Tensor] = {}
    meta = _split_state(state, "", tensors)
    save_file(tensors, str(folder / TENSORS_FILE))
    (folder / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")


def load_method_state(folder: Path) -> MethodState:
    meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    tensors = load_file(str(folder / TENSORS_FILE))
    joined: MethodState = _join_state(meta, tensors)
    return joined
