"""One writer at a time in an output folder."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from forgetless.errors import ConfigError, EnvironmentFault


class OutDirLock:
    """An exclusive lock on the output folder (``flock`` on the folder itself).

    A second writer is refused at once. The kernel drops the lock when its holder dies, so a lock
    left by a killed run is simply taken over. A folder this lock created is removed again if the
    run leaves it empty (a run refused before writing anything leaves no trace).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.created = False
        self.fd: int | None = None

    def __enter__(self) -> OutDirLock:
        if self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(f"{self.folder}: --out is a file, not a folder")
        self.created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.folder, os.O_RDONLY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._close()
            raise EnvironmentFault(
                f"{self.folder}: another forgetless process is writing to this folder; "
                "wait for it to end or use another --out"
            ) from None
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._close()
        if self.created and self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None
