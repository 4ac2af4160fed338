"""A preset layers under a user's config (the file's keys win) and validate says what it set;
a run into a log that is not a terminal prints each phase's start and its rate and time left;
``bench --jobs`` warns when its runs need more threads than the usable cores (issue 51)."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from forgetless.cli.app import run_cli
from forgetless.config.loading import load_config
from forgetless.errors import ConfigError
from forgetless.testing import tiny_run_config


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = run_cli(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_a_preset_key_sits_under_the_files_own_keys(tmp_path: Path) -> None:
    own = {
        "preset": "smollm2",
        "tasks": ["reverse", "cipher"],
        "train": {"steps": 7},
        "finetune": {"lora": {"r": 4}},
    }
    cfg = load_config(write_yaml(tmp_path / "mine.yaml", own))
    assert [t.builtin for t in cfg.tasks] == ["reverse", "cipher"]
    assert cfg.train.steps == 7 and cfg.train.lr == 5e-4  # the file's key, the preset's beside
    assert cfg.finetune.mode == "lora" and cfg.finetune.lora.r == 4
    assert cfg.finetune.lora.alpha == 16 and cfg.finetune.lora.layers == list(range(22, 30))
    assert cfg.model.name_or_path == "smollm2-135m-instruct"


def test_validate_with_preset_and_config_prints_what_the_preset_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_yaml(tmp_path / "mine.yaml", {"tasks": ["reverse"], "train": {"steps": 7}})
    code, out, err = cli(
        capsys, "validate", str(config), "--preset", "smollm2", "--set", "train.lr=0.001"
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"preset smollm2 set 20 keys that {config} leaves out:"
    assert "  finetune.mode: lora" in lines and "  eval.n_eval: 48" in lines
    own = ("  train.steps:", "  train.lr:", "  tasks:")  # the file's and the override's
    assert not [line for line in lines if line.startswith(own)]
    assert "lora fine-tuning, tasks: reverse" in lines[-1]


def test_an_unknown_preset_is_one_line_naming_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_yaml(tmp_path / "mine.yaml", {"preset": "smolm2", "tasks": ["reverse"]})
    code, _, err = cli(capsys, "validate", str(config))
    assert code == 2
    assert err == (
        f"error: {config}: preset: unknown preset 'smolm2'; known: tiny, smollm2; "
        "did you mean 'smollm2'?"
    )
    with pytest.raises(
        ConfigError, match=r"^--preset: unknown preset 'big'; known: tiny, smollm2$"
    ):
        load_config(config, preset="big")


def test_a_progress_line_gives_the_rate_and_the_time_left() -> None:
    from forgetless.engine.progress import Heartbeat

    lines: list[str] = []
    ticks = iter([0.0, 63.2])
    beat = Heartbeat(
        lines.append, "task 2/4 train it-json", 500, clock=lambda: next(ticks), unit="step"
    )
    beat.beat(120)
    assert lines == ["task 2/4 train it-json: step 120/500, 1.9 step/s, 3m20s left"]


def test_a_long_phase_prints_a_line_at_each_tenth_at_most_every_ten_seconds() -> None:
    from forgetless.engine.progress import Heartbeat

    lines: list[str] = []
    now = [0.0]
    beat = Heartbeat(lines.append, "evaluate", 100, clock=lambda: now[0], every=30.0)
    for step in range(100):
        now[0] = step * 0.5  # a tenth every 5 s
        beat.beat()
    # the first after 10 s, then a tenth passed once the line before is 10 s old
    shown = [line.split(",")[0] for line in lines]
    assert shown == [f"evaluate: {n}/100" for n in (21, 50, 70, 90)]


def test_a_bad_progress_interval_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from forgetless.engine.progress import Progress

    monkeypatch.setenv("FORGETLESS_PROGRESS_EVERY", "soon")
    progress = Progress(Console(file=io.StringIO()))
    expected = r"^FORGETLESS_PROGRESS_EVERY='soon': expected a number"
    with pytest.raises(ConfigError, match=expected), progress, progress.task("evaluate", 3):
        pass


def test_a_run_into_a_log_prints_each_phase_and_its_rate(
    tmp_path: Path,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FORGETLESS_PROGRESS_EVERY", "0")  # a line at every step
    config = write_yaml(tmp_path / "run.yaml", tiny_run_config(tiny_model_dir))
    code, out, err = cli(capsys, "run", str(config), "--out", str(tmp_path / "out"))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"run: {config} → {tmp_path / 'out'}, method seq_ft, 2 tasks")
    starts = [line for line in lines if ": start, " in line]
    assert starts == [
        "evaluate: start, 0/3",  # the base
        "task 1/2 train reverse: start, step 0/4",
        "evaluate: start, 0/3",
        "task 2/2 train cipher: start, step 0/4",
        "evaluate: start, 0/3",
    ]
    rate = re.compile(r"^task 2/2 train cipher: step 4/4, [0-9.]+ step/s, 0s left$")
    assert any(rate.match(line) for line in lines), out
    assert any(re.match(r"^evaluate: 3/3, [0-9.]+/s, 0s left$", line) for line in lines), out


def test_a_quiet_run_prints_its_rate_but_no_phase_start(
    tmp_path: Path,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FORGETLESS_PROGRESS_EVERY", "0")
    config = write_yaml(tmp_path / "run.yaml", tiny_run_config(tiny_model_dir))
    code, out, err = cli(capsys, "run", str(config), "--out", str(tmp_path / "out"), "--quiet")
    assert code == 0, err
    assert "task 1/2 train reverse: step 4/4, " in out
    assert ": start, " not in out and not out.startswith("run: ")


def test_bench_jobs_warns_when_the_runs_need_more_threads_than_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from forgetless.bench import sweep

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)

    def stop(*args: Any, **kwargs: Any) -> None:
        raise ConfigError("stopped before any run")

    monkeypatch.setattr(sweep, "run_bench", stop)
    out = str(tmp_path / "bench")
    _, _, err = cli(capsys, "bench", "--jobs", "4", "--out", out)
    assert err.splitlines()[0] == (
        "warning: --jobs 4 × 1 thread(s) per run = 4 threads on 2 usable cores: running anyway, "
        "but the runs take turns on the cores (each slower, timings noisier); "
        "set --jobs 2 --threads 1 to fit"
    )
    _, _, err = cli(capsys, "bench", "--jobs", "2", "--threads", "2", "--out", out)
    assert "set --threads 1 (or fewer --jobs) to fit" in err.splitlines()[0]
    _, _, err = cli(capsys, "bench", "--jobs", "2", "--out", out)
    assert err == "error: stopped before any run"
