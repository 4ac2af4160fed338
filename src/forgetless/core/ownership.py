"""Which folders and files forgetless may write into: the ones it made, never a user's.

Every command that takes ``--out`` goes through ``check_output_folder`` (a folder it fills) or
``check_output_file`` (a file it writes) before it writes anything. A folder is forgetless's when
it carries ``MARKER`` (written by ``mark_folder``), or, for folders written before the marker
existed, the kind's own manifest (``LEGACY_MANIFESTS``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from forgetless.core.storage import atomic_dir, atomic_write_json
from forgetless.errors import ConfigError

MARKER = ".forgetless.json"
KINDS = ("run", "bench", "merge", "export", "pretrain", "sae")
LEGACY_MANIFESTS = {
    "run": "results.json",
    "bench": "bench.json",
    "merge": "merge.json",
    "export": "export.json",
    "pretrain": "pretrain.json",
    "sae": "sae_config.json",
}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def folder_owner(folder: Path) -> str | None:
    """The kind of forgetless output ``folder`` holds, or None when forgetless did not write it."""
    marker = _read_json(folder / MARKER)
    if isinstance(marker, dict) and marker.get("written_by") == "forgetless":
        kind = marker.get("kind")
        return kind if kind in KINDS else None
    for kind, manifest in LEGACY_MANIFESTS.items():
        if isinstance(_read_json(folder / manifest), dict):
            return kind
    return None


def marker_record(folder: Path) -> dict[str, Any]:
    """The marker's fields (empty when there is none)."""
    marker = _read_json(folder / MARKER)
    return marker if isinstance(marker, dict) else {}


def mark_folder(folder: Path, kind: str, **fields: Any) -> None:
    """Write the marker that makes ``folder`` a ``kind`` output of forgetless."""
    atomic_write_json(folder / MARKER, {"written_by": "forgetless", "kind": kind, **fields})


def _contains(folder: Path, path: Path) -> bool:
    target, inner = folder.resolve(), path.resolve()
    return inner == target or target in inner.parents


Inputs = Iterable[Path] | Mapping[str, Path]
"""The files a command reads, each named by its place in the config where it has one."""


def _refuse_inputs(out: Path, inputs: Inputs, place: str) -> None:
    named = inputs.items() if isinstance(inputs, Mapping) else ((str(p), p) for p in inputs)
    for label, source in named:
        if _contains(out, source):
            how = "is" if out.resolve() == source.resolve() else "holds"
            raise ConfigError(
                f"{out}: {how} the input {label}; an input is never an output: "
                f"choose another {place}"
            )


def check_output_folder(out: Path, kind: str, inputs: Inputs = (), place: str = "--out") -> bool:
    """Refuse ``out`` unless it is new, empty, or already a ``kind`` output of forgetless;
    ``place`` is how the caller names ``out`` (``--out``, ``OUT``, ``out_dir``).

    Returns whether it already holds one (a resume, or a replacement of an earlier output).
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: {place} is a file, not a folder")
    _refuse_inputs(out, inputs, place)
    if not out.exists() or not any(out.iterdir()):
        return False
    owner = folder_owner(out)
    if owner == kind:
        return True
    if owner is not None:
        raise ConfigError(
            f"{out}: holds a forgetless {owner} output, not a {kind} one; choose another {place}"
        )
    names = ", ".join(sorted(p.name for p in out.iterdir())[:3])
    raise ConfigError(
        f"{out}: not empty and not written by forgetless (holds {names}); forgetless never "
        f"writes over files it did not write: choose a new or empty {place}"
    )


@contextmanager
def replace_output(
    out: Path, kind: str, inputs: Inputs = (), place: str = "--out"
) -> Iterator[Path]:
    """Check that ``out`` may hold a ``kind`` output, then yield a folder to write it in whole:
    it takes ``out``'s place, marked, only once the block ends without an error; until then, and
    after an interrupt at any point, ``out`` is as it was (or absent when it was new)."""
    check_output_folder(out, kind, inputs, place)
    with atomic_dir(out) as folder:
        yield folder
        mark_folder(folder, kind)


def check_output_file(
    out: Path, kind: str, default_name: str, siblings: Iterable[Path] = ()
) -> None:
    """Refuse a ``kind`` output file ``out`` that would replace anything but an earlier ``kind``
    output: a folder, a file forgetless did not write, or another output's file. ``siblings`` are
    files written beside it (a plot, a table), replaced only along with an earlier output."""
    if out.is_dir():
        raise ConfigError(f"{out}: is a folder; give a file path such as {out / default_name}")
    earlier = out.is_file()
    if earlier and not _is_output_of(out, kind, default_name):
        raise ConfigError(
            f"{out}: exists and is not a {kind} output of forgetless; choose another --out "
            "(forgetless never writes over files it did not write)"
        )
    for sibling in siblings:
        if sibling.exists() and not earlier:
            raise ConfigError(
                f"{sibling}: exists and would be replaced by the {kind} output {out.name}; "
                "choose another --out"
            )


def _is_output_of(path: Path, kind: str, default_name: str) -> bool:
    data = _read_json(path)
    if not isinstance(data, dict):
        return False
    if data.get("written_by") == "forgetless":
        return data.get("kind") == kind
    return path.name == default_name  # written before outputs carried their kind


def write_output_file(path: Path, kind: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically, marked as a ``kind`` output of forgetless."""
    atomic_write_json(path, {"written_by": "forgetless", "kind": kind, **data})
