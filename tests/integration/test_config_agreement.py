"""``validate`` and the command that runs a file give the same verdict on every shipped config:
a file ``validate`` calls ok is one ``run`` starts, and one it refuses, ``run`` refuses too."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from forgetless.cli.app import run_cli
from forgetless.training.runner import Runner

ROOT = Path(__file__).resolve().parents[2]


def shipped_configs() -> list[Path]:
    """The examples' configs and every campaign or benchmark config (where those folders are
    present: the library's tests pass without them)."""
    found = sorted((ROOT / "examples").glob("*.yaml"))
    for place in ("benchmarks", "studies"):
        found += sorted(p for p in (ROOT / place).rglob("configs/*.yaml"))
    return found


def reached_the_runner(self: Runner) -> None:
    raise typer.Exit(0)  # the file was accepted: nothing needs to train


@pytest.mark.parametrize("config", shipped_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_validate_and_run_agree(
    config: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Runner, "run", reached_the_runner)
    validated = run_cli(["validate", str(config)])
    ran = run_cli(["run", str(config), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert (validated, ran) == (0, 0), err


def test_a_bench_section_is_typed_for_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("tasks: [reverse]\nbench: {seeds: 0}\n", encoding="utf-8")
    for command in (["validate", str(config)], ["run", str(config), "--out", str(tmp_path / "o")]):
        assert run_cli(command) == 2
        assert "bench.seeds: Input should be greater than or equal to 1" in capsys.readouterr().err
