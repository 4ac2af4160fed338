"""Atomic writes (temp name + rename); method state as safetensors plus JSON.

Every temporary name carries ``TEMP_MARK``, a marker only this program makes, so that cleaning up
after a killed write never deletes a file a user put in the output folder.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from forgetless.core.distributed import is_main_process
from forgetless.core.paths import cache_root
from forgetless.core.rundir import RunDir
from forgetless.errors import CheckpointError, EnvironmentFault, ForgetlessError

MethodState = dict[str, Any]
"""A method's resumable state: tensors, JSON values, and nested dicts of those."""

TENSORS_FILE = "method_state.safetensors"
META_FILE = "method_state.json"
TEMP_MARK = "forgetless-tmp"
_TEMP_FILE = re.compile(rf"^\..+\.{TEMP_MARK}-\d+$")
_SWAP_DIR = re.compile(rf"^\.{TEMP_MARK}-(new|old)-(.+)$")

swap_point: Callable[[str], None] = lambda point: None  # noqa: E731
"""Called at each step of ``atomic_dir``'s swap; the fault-injection tests plant a kill here."""


NO_SPACE = "No space left on device"
"""strerror(ENOSPC), also in the message of a full disk met inside safetensors or tokenizers."""


class DiskFull(EnvironmentFault, OSError):
    """A full disk: one line naming the file at the CLI, and still an OSError (ENOSPC) to code
    that handles a failed write."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(
            f"{path}: {NO_SPACE} (free some space and re-run: a run resumes from its last "
            "checkpoint)"
        )
        self.errno = errno.ENOSPC


def is_disk_full(err: BaseException) -> bool:
    """A full disk (or quota), raised as an OSError or worded in a library's own error."""
    if isinstance(err, ForgetlessError):
        return False  # already one line (an inner write named its file)
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return NO_SPACE in str(err)


@contextmanager
def disk_writes(path: Path) -> Iterator[None]:
    """Turn a full disk met while writing ``path`` into a one-line EnvironmentFault naming it."""
    try:
        yield
    except Exception as err:
        if is_disk_full(err):
            raise DiskFull(path) from err
        raise


def temp_file_name(path: Path) -> Path:
    """The temporary sibling of ``path`` that an atomic write of it goes through."""
    return path.with_name(f".{path.name}.{TEMP_MARK}-{os.getpid()}")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder and an atomic rename.

    Only the main process writes; the others (which hold the same results) write nothing.
    """
    if not is_main_process():
        return
    tmp = temp_file_name(path)
    with disk_writes(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with tmp.open("w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _swap_dir(final: Path, kind: str) -> Path:
    return final.with_name(f".{TEMP_MARK}-{kind}-{final.name}")


def recover_dir(final: Path) -> None:
    """Finish or undo what a kill left of an ``atomic_dir`` swap of ``final``.

    Killed after the old copy was moved aside but before the new one took its place: the old copy
    comes back (the write it replaced was never committed). Killed while the old copy was being
    removed: the rest of it goes. A new copy never renamed into place is thrown away.
    """
    new, old = _swap_dir(final, "new"), _swap_dir(final, "old")
    if old.exists():
        if final.exists():
            shutil.rmtree(old)
        else:
            os.rename(old, final)
    if new.exists():
        shutil.rmtree(new)


def remove_stale_temps(folder: Path) -> list[Path]:
    """Clean up after killed atomic writes in ``folder`` and under its ``checkpoints/``.

    Only names this program makes are touched: ``.NAME.forgetless-tmp-PID`` files and
    ``.forgetless-tmp-{new,old}-NAME`` folders (recovered with ``recover_dir``).
    """
    found = [p for p in folder.glob(".*") if _TEMP_FILE.match(p.name) and p.is_file()]
    checkpoints = RunDir(folder).checkpoints
    swaps = (
        [p for p in checkpoints.rglob(".*") if _SWAP_DIR.match(p.name)]
        if checkpoints.is_dir()
        else []
    )
    for path in found:
        path.unlink(missing_ok=True)
    for path in sorted(swaps, key=lambda p: len(p.parts), reverse=True):
        match = _SWAP_DIR.match(path.name)
        if match and path.exists():
            recover_dir(path.with_name(match.group(2)))
    return [*found, *swaps]


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, allow_nan=True) + "\n")


@contextmanager
def cache_fill_lock(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s lock while checking and filling it.

    Every writer of one folder swaps through the same ``.new`` name, so two runs filling a cache
    at once (``bench --jobs 2`` on a fresh cache) would write into each other's copy; the second
    waits here and then finds the folder filled. The lock file lives in the cache's ``locks/``,
    so no file is left beside the folder (which may be in a run's output).
    """
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    with FileLock(str(lock_folder() / f"{key}.lock")):
        yield


def lock_folder() -> Path:
    """The cache's ``locks/``, or, where the cache cannot be written (a read-only home with the
    SAE or model kept in a run folder), one under the system's temp folder: the lock only has
    to be shared by the processes of this machine."""
    user = os.getuid() if hasattr(os, "getuid") else 0  # another user's folder is not ours
    temp = Path(tempfile.gettempdir()) / f"forgetless-locks-{user}"
    for locks in (cache_root() / "locks", temp):
        try:
            locks.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(locks, os.W_OK):  # a locks/ left read-only is no place for a lock either
            return locks
    raise EnvironmentFault(
        f"$FORGETLESS_CACHE ({cache_root()}): cannot make its locks/ folder, nor the temp one"
    )


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp folder beside ``final``; on success it takes ``final``'s place.

    The swap is rename-aside, rename-in, remove: a kill at any point leaves either the old or the
    new folder whole, and ``recover_dir`` (run first here and on every resume) tidies up the rest.
    On a process other than the main one the folder is a scratch one, thrown away afterwards.
    """
    if not is_main_process():
        with tempfile.TemporaryDirectory(prefix="forgetless-") as scratch:
            yield Path(scratch)
        return
    recover_dir(final)
    new, old = _swap_dir(final, "new"), _swap_dir(final, "old")
    with disk_writes(final):
        new.mkdir(parents=True)
        try:
            yield new
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            raise
    try:
        swap_point("written")
        if final.exists():
            os.rename(final, old)
            swap_point("aside")
        os.rename(new, final)
    except BaseException:  # an interrupt mid-swap: the old folder goes back, whole
        recover_dir(final)
        raise
    swap_point("swapped")
    try:
        if old.exists():
            shutil.rmtree(old)
    except BaseException:  # the new folder is in place: finish removing the old one
        shutil.rmtree(old, ignore_errors=True)
        raise


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
