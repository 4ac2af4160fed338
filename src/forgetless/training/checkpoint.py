"""Atomic writes (temp name + rename); method state as safetensors plus JSON."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from forgetless.errors import CheckpointError
from forgetless.training.distributed import is_main_process

if TYPE_CHECKING:  # the methods package imports its methods, which import this module
    from forgetless.methods.base import MethodState

TENSORS_FILE = "method_state.safetensors"
META_FILE = "method_state.json"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and an atomic rename.

    Only the main process writes; the others (which hold the same results) write nothing.
    """
    if not is_main_process():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete what a killed atomic write left in ``folder`` (and its ``checkpoints/``)."""
    gone = [*folder.glob(".*.tmp-*"), *folder.glob("checkpoints/.tmp-*")]
    for path in gone:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return gone


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, allow_nan=True) + "\n")


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp folder beside ``final``; on success it replaces ``final`` in one rename.

    On a process other than the main one the folder is a scratch one, thrown away afterwards.
    """
    if not is_main_process():
        with tempfile.TemporaryDirectory(prefix="forgetless-") as scratch:
            yield Path(scratch)
        return
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


def _unreadable(path: Path, err: BaseException) -> CheckpointError:
    text = str(err).strip().splitlines()
    why = text[0] if text else type(err).__name__
    return CheckpointError(f"{path}: unreadable ({why}); the file is truncated or corrupted")


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors' names and shapes from a safetensors header (checks that it covers the file)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (weights are read from safetensors only)")
    try:
        with safe_open(str(path), "pt") as handle:
            return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as err:
        raise _unreadable(path, err) from None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """``load_file`` with one-line CheckpointErrors for a missing, truncated or corrupt file."""
    tensor_shapes(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise _unreadable(path, err) from None


def check_fits(path: Path, shapes: dict[str, tuple[int, ...]], model: nn.Module) -> None:
    """Refuse a checkpoint whose tensors do not match ``model``'s names and shapes."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, shape in shapes.items():
        if name not in own:
            raise CheckpointError(
                f"{path}: tensor {name!r} is not in the model: the checkpoint is from another model"
            )
        if own[name] != shape:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(shape)}, the model's is "
                f"{list(own[name])}: the checkpoint is from another model"
            )


def load_method_state(folder: Path) -> MethodState:
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _unreadable(folder / META_FILE, err) from None
    tensors = read_tensors(folder / TENSORS_FILE)
    joined: MethodState = _join_state(meta, tensors)
    return joined
