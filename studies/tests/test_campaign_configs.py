"""Every campaign config validates, and a run unpacked from its campaign's file is one that
``forgetless bench --campaign`` skips."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from runs import pack_path, read_pack, unpack

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_a_campaign_config_validates(
    config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from forgetless.cli.app import main

    monkeypatch.setattr(sys, "argv", ["forgetless", "validate", str(config)])
    main()
    assert "ok:" in capsys.readouterr().out


def test_an_unpacked_run_is_one_the_bench_skips(tmp_path: Path) -> None:
    from forgetless.bench.campaign import load_record

    records = read_pack(pack_path("claims-o-lora"))
    runs = sorted(records)
    assert len(runs) == 15
    for run, path in zip(runs, unpack(records, runs, tmp_path), strict=True):
        assert path == tmp_path / f"{run}.json"
        assert load_record(path, records[run]["config_key"]) == records[run]
        assert load_record(path, "another config") is None
