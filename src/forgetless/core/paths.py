"""Where forgetless keeps what it builds once and reuses: the tiny base, SAEs, activations."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$FORGETLESS_CACHE``, or ``~/.cache/forgetless``."""
    return Path(os.environ.get("FORGETLESS_CACHE", Path.home() / ".cache" / "forgetless"))
