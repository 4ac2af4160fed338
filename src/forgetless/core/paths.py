"""Where forgetless keeps what it builds once and reuses (the tiny base, SAEs, activations), and
the reading of a small text file that may be absent."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$FORGETLESS_CACHE``, or ``~/.cache/forgetless``."""
    return Path(os.environ.get("FORGETLESS_CACHE", Path.home() / ".cache" / "forgetless"))


def read_stripped(path: Path, encoding: str = "utf-8") -> str | None:
    """The text of ``path`` without surrounding whitespace; None where it cannot be read."""
    try:
        return path.read_text(encoding=encoding).strip()
    except OSError:
        return None
