"""Whether the Hugging Face hub can give a model or dataset now, decided before asking it.

Offline (``HF_HUB_OFFLINE=1``) or without a network, ``from_pretrained`` and ``load_dataset``
first retry the hub for up to a minute, then fail with a message that does not say the id is
simply not cached. A hub id that is neither a local folder nor in the cache is refused at once
instead, in one line; one that is cached is read from the cache alone.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants, try_to_load_from_cache

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
"""Behind a proxy the hub's host cannot be probed directly: it is taken as reachable."""
CONNECT_SECONDS = 3.0


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


@functools.cache
def hub_reachable(timeout: float = CONNECT_SECONDS) -> bool:
    """Whether a TCP connection to the hub's host opens within ``timeout`` (asked once)."""
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return True
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or 443
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def why_unreachable(datasets: bool = False) -> str | None:
    """Why nothing can be downloaded now (offline mode, or no route to the hub), or None."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if datasets else ("HF_HUB_OFFLINE",)
    for name in names:
        if _truthy(os.environ.get(name)):
            return f"{name}=1 is set"
    if not hub_reachable():
        return f"{urlparse(constants.ENDPOINT).hostname} cannot be reached"
    return None


def model_cached(repo_id: str, revision: str | None) -> bool:
    """Whether the hub cache holds the model's ``config.json`` (at ``revision``)."""
    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except ValueError:  # not a valid repo id: nothing of it can be cached
        return False
    return isinstance(found, str)


def dataset_cached(path: str) -> bool:
    """Whether the hub cache, or the datasets cache, holds anything of the dataset ``path``."""
    import datasets

    hub = Path(constants.HF_HUB_CACHE) / f"datasets--{path.replace('/', '--')}"
    built = Path(datasets.config.HF_DATASETS_CACHE) / path.replace("/", "___")
    return hub.is_dir() or built.is_dir()


def not_cached(place: str, why: str) -> str:
    """The one line for a hub id that cannot be had now; ``place`` names it (``dataset 'x'``)."""
    return (
        f"{place} is not a local folder and not in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}), and {why}: download it where there is a network "
        "(huggingface-cli download) or name a local folder"
    )
