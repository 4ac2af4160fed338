"""One writer at a time in an output folder."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from forgetless.core.ownership import MARKER, check_output_folder, mark_folder
from forgetless.core.paths import read_stripped
from forgetless.errors import EnvironmentFault

PID_FILE = ".forgetless.pid"
"""The lock holder's PID, so that a refused second writer can name it."""


def holder(folder: Path) -> str:
    """`` (PID n)`` for the process that holds ``folder``'s lock, when it says."""
    pid = read_stripped(folder / PID_FILE)
    return f" (PID {pid})" if pid is not None and pid.isdigit() else ""


class OutDirLock:
    """An exclusive lock on a ``kind`` output folder (``flock`` on the folder itself).

    The folder must be new, empty or already a ``kind`` output of forgetless, and must not hold
    one of ``inputs`` (``core.ownership``); it is marked as forgetless's once locked. A second
    writer is refused at once, naming the holder's PID. The kernel drops the lock when its holder
    dies, so a lock left by a killed run is simply taken over. A folder this lock created is
    removed again if the run leaves nothing in it but the marker (a run refused before writing
    anything leaves no trace).
    """

    def __init__(self, folder: Path, kind: str = "run", inputs: Iterable[Path] = ()) -> None:
        self.folder, self.kind, self.inputs = folder, kind, tuple(inputs)
        self.created = False
        self.fd: int | None = None

    def __enter__(self) -> OutDirLock:
        check_output_folder(self.folder, self.kind, self.inputs)
        self.created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.folder, os.O_RDONLY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._close()
            raise EnvironmentFault(
                f"{self.folder}: another forgetless process is writing to this folder"
                f"{holder(self.folder)}; wait for it to end or use another --out"
            ) from None
        if not (self.folder / MARKER).is_file():
            mark_folder(self.folder, self.kind)
        (self.folder / PID_FILE).write_text(str(os.getpid()), encoding="utf-8")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        (self.folder / PID_FILE).unlink(missing_ok=True)
        self._close()
        left = {p.name for p in self.folder.iterdir()} if self.folder.is_dir() else {"?"}
        if self.created and left <= {MARKER}:
            (self.folder / MARKER).unlink(missing_ok=True)
            self.folder.rmdir()

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None
