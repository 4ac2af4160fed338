"""The campaigns' packed files: the same records give the same bytes, and runs round-trip
through the per-run files ``forgetless bench --campaign`` reads."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from runs import (
    CAMPAIGNS,
    folder_records,
    kept_record,
    pack_bytes,
    read_pack,
    selected,
    unpack,
)

PACKS = sorted(CAMPAIGNS.glob("*.jsonl.gz"))


@pytest.mark.parametrize("pack", PACKS, ids=lambda p: p.name)
def test_a_kept_file_is_what_its_records_pack_to(pack: Path) -> None:
    records = read_pack(pack)
    assert records and all(run.count("/") == 2 for run in records)  # device/variant/run
    packed = pack.read_bytes()
    assert packed[4:8] == bytes(4)  # gzip's mtime field: fixed
    # the lines, not the compressed bytes: another zlib build may compress the same text otherwise
    assert gzip.decompress(pack_bytes(records)) == gzip.decompress(packed)


def test_runs_round_trip_through_their_files(tmp_path: Path) -> None:
    records = read_pack(CAMPAIGNS / "real-rl.jsonl.gz")
    unpack(records, selected(records, []), tmp_path)
    assert folder_records(tmp_path) == records
    text = (tmp_path / "cpu" / "sft" / "s0.json").read_text(encoding="utf-8")
    assert text.startswith('{\n  "record_version": 1,\n')  # as the bench writes it


def test_a_run_is_named_whole_or_by_a_leading_part() -> None:
    records: dict[str, dict] = {r: {} for r in ("cpu/a/s0", "cpu/a/s1", "cpu/ab/s0")}
    assert selected(records, ["cpu/a"]) == ["cpu/a/s0", "cpu/a/s1"]
    assert selected(records, ["cpu/ab/s0", "cpu/a/s1", "cpu/ab"]) == ["cpu/ab/s0", "cpu/a/s1"]
    with pytest.raises(SystemExit, match="no kept run 'cpu/b'"):
        selected(records, ["cpu/b"])


def test_a_record_counts_only_under_its_config_key() -> None:
    records = {"cpu/a/s0": {"config_key": "k", "summary": {}}, "cpu/a/s1": {"config_key": "k"}}
    assert kept_record(records, "cpu/a/s0", "k") == records["cpu/a/s0"]
    assert kept_record(records, "cpu/a/s0", "other") is None
    assert kept_record(records, "cpu/a/s1", "k") is None  # no summary: not a finished run
    assert kept_record(records, "cpu/a/s2", "k") is None
