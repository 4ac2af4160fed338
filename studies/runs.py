"""The campaigns' kept runs, one compressed JSON-lines file per campaign: read, unpack, pack.

``forgetless bench CONFIG --campaign DIR`` keeps each finished run as
``DIR/<device>/<variant>/<run>.json`` and skips the runs kept there. The studies keep a
campaign's records in ``studies/results/campaigns/<campaign>.jsonl.gz`` instead: one line per run,
``{"run": "cpu/seq_ft/s0", "record": {...}}``, sorted by run, gzip with a fixed mtime, so that
packing the same records again gives the same bytes. A record keeps the key order the bench wrote
(renderers walk some of its mappings in that order), so unpacking gives back each file byte for
byte.

    python studies/runs.py list CAMPAIGN
    python studies/runs.py unpack CAMPAIGN [RUN ...] [--to DIR]   # DIR: runs/campaigns/CAMPAIGN
    python studies/runs.py pack CAMPAIGN [--from DIR]             # merges DIR's runs into the file

A RUN is a record's path in the campaign folder without ``.json`` (``cpu/seq_ft/s0``), or a
leading part of it (``cpu/seq_ft``: every seed of that variant).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CAMPAIGNS = ROOT / "studies" / "results" / "campaigns"
UNPACKED = ROOT / "runs" / "campaigns"
Records = dict[str, dict[str, Any]]
"""A record's path in the campaign folder without ``.json`` (``cpu/seq_ft/s0``) → the record."""


def pack_path(campaign: str, folder: Path = CAMPAIGNS) -> Path:
    return folder / f"{campaign}.jsonl.gz"


def read_pack(path: Path) -> Records:
    """Every record of a packed campaign (none when the file is not there)."""
    if not path.is_file():
        return {}
    lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
    return {line["run"]: line["record"] for line in map(json.loads, lines)}


def pack_bytes(records: Records) -> bytes:
    """The packed file's bytes: the same records always give the same bytes."""
    lines = "".join(
        json.dumps({"run": run, "record": records[run]}, allow_nan=True) + "\n"
        for run in sorted(records)
    )
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as out:
        out.write(lines.encode("utf-8"))
    return buffer.getvalue()


def write_pack(path: Path, records: Records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(pack_bytes(records))
    os.replace(partial, path)


def kept_record(records: Records, run: str, key: str) -> dict[str, Any] | None:
    """The kept record of ``run`` when it was made under the config ``key``; else None: what
    ``forgetless.bench.campaign.load_record`` decides for the unpacked file."""
    record = records.get(run)
    if not isinstance(record, dict) or record.get("config_key") != key:
        return None
    return record if isinstance(record.get("summary"), dict) else None


def folder_records(folder: Path) -> Records:
    """The records a campaign folder holds, ``<device>/<variant>/<run>.json``."""
    return {
        path.relative_to(folder).with_suffix("").as_posix(): json.loads(path.read_text("utf-8"))
        for path in sorted(folder.glob("*/*/*.json"))
    }


def selected(records: Records, runs: list[str]) -> list[str]:
    """The runs named (each a run or a leading part of one); all of them when none is named."""
    if not runs:
        return sorted(records)
    chosen = []
    for wanted in runs:
        prefix = wanted.strip("/")
        found = [r for r in sorted(records) if r == prefix or r.startswith(prefix + "/")]
        if not found:
            raise SystemExit(f"no kept run {wanted!r}; `list` names them")
        chosen += [r for r in found if r not in chosen]
    return chosen


def unpack(records: Records, runs: list[str], folder: Path) -> list[Path]:
    """Write the chosen records as the bench writes them, where ``--campaign folder`` finds them."""
    from forgetless.core.storage import atomic_write_json

    written = []
    for run in runs:
        path = folder / f"{run}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, records[run])
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="the runs a campaign keeps")
    unpacking = commands.add_parser("unpack", help="write runs as per-run JSON files")
    packing = commands.add_parser("pack", help="merge a folder's runs into the packed file")
    for command in (listing, unpacking, packing):
        command.add_argument("campaign", help="the config's stem: real, claims-anchored, ...")
    unpacking.add_argument("runs", nargs="*", help="cpu/VARIANT/RUN or a leading part of it")
    unpacking.add_argument("--to", type=Path, help="default: runs/campaigns/CAMPAIGN")
    packing.add_argument(
        "--from", dest="source", type=Path, help="default: runs/campaigns/CAMPAIGN"
    )
    args = parser.parse_args()
    path = pack_path(args.campaign)
    records = read_pack(path)
    if args.command == "list":
        print("\n".join(sorted(records)))
    elif args.command == "unpack":
        written = unpack(records, selected(records, args.runs), args.to or UNPACKED / args.campaign)
        print(f"{len(written)} runs → {args.to or UNPACKED / args.campaign}")
    else:
        found = folder_records(args.source or UNPACKED / args.campaign)
        merged = records | found
        write_pack(path, merged)
        added = len(merged) - len(records)
        print(f"{len(found)} runs read, {added} new; {len(merged)} kept in {path}")


if __name__ == "__main__":
    main()
