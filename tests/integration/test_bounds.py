"""Sizes a run cannot hold are refused at validate, before anything loads, in one line naming
the config place; a task count whose evaluation grows with its square is warned about; long
work prints plain progress lines where no bar is drawn (docs/reliability.md)."""

from __future__ import annotations

import io
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console
from test_bad_inputs import small_config, write_config

from forgetless.cli.app import run_cli
from forgetless.config import bounds
from forgetless.config.loading import validate_config
from forgetless.engine.progress import Progress
from forgetless.models.tiny import build_char_tokenizer
from forgetless.tasks.builtin import build_builtin_task, known_task_names
from forgetless.tasks.formatting import encode_training_set
from forgetless.tasks.general import GENERAL_PROBES

HUGE = "eval.n_train=2000000000"


@pytest.fixture(autouse=True)
def machine_of_16_gb(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounds, "machine_memory", lambda: 16 * 10**9)
    monkeypatch.setattr(bounds, "available_memory", lambda: 12 * 10**9)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = run_cli(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def one_line(err: str) -> str:
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


def test_validate_refuses_n_train_beyond_the_machine(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path / "one.yaml", small_config(tiny_model_dir))
    code, _, err = cli(capsys, "validate", str(config), "--set", HUGE)
    assert code == 2
    assert "eval.n_train: 2000000000 examples per task" in one_line(err)
    assert "the machine has 16.0 GB" in err


def test_run_refuses_it_before_anything_is_loaded_or_written(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path / "one.yaml", small_config(tiny_model_dir))
    out = tmp_path / "out"
    code, _, err = cli(capsys, "run", str(config), "--out", str(out), "--quiet", "--set", HUGE)
    assert code == 2 and "eval.n_train" in one_line(err)
    assert not out.exists()


def test_a_task_of_its_own_size_is_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    tasks = ["reverse", {"builtin": "cipher", "n_train": 10**9}]
    with pytest.raises(Exception, match=r"tasks\.1\.n_train: 1000000000 examples would need"):
        validate_config(small_config(tiny_model_dir, tasks=tasks), "c.yaml")


def test_validate_warns_about_a_quadratic_number_of_tasks(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks = [{"builtin": "reverse", "name": f"r{i}"} for i in range(60)]
    data = small_config(tiny_model_dir, tasks=tasks, probes=["copy"])
    config = write_config(tmp_path / "many.yaml", data)
    code, out, _ = cli(capsys, "validate", str(config))
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "tasks: 60 tasks" in lines[0]
    assert "61 rows x 61 = 3721 evaluations" in " ".join(out.split())
    assert "(60 tasks)" in out  # the ok line lists the first names, not all sixty


def test_validate_warns_when_the_run_needs_more_than_is_free(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path / "one.yaml", small_config(tiny_model_dir))
    code, out, _ = cli(capsys, "validate", str(config), "--set", "eval.n_train=2800000")
    assert code == 0
    text = " ".join(out.split())
    assert "warning:" in text and "eval.n_train: 2800000 examples per task" in text
    assert "12.0 GB is free now" in text


def fake_clock(times: list[float]) -> Iterator[float]:
    yield from times


def test_quiet_progress_prints_plain_lines_once_work_is_long() -> None:
    out = io.StringIO()
    ticks = fake_clock([0.0, 1.0, 2.0, 10.5, 11.0, 41.0])
    progress = Progress(Console(file=out, width=200), enabled=False, clock=lambda: next(ticks))
    with progress, progress.task("evaluate", 10000) as advance:
        for _ in range(5):
            advance(None)
    assert out.getvalue().splitlines() == [
        "evaluate: 3/10000, 0.29/s, 9h43m left",
        "evaluate: 5/10000, 0.12/s, 22h45m left",
    ]


def test_short_work_prints_no_progress_line() -> None:
    out = io.StringIO()
    progress = Progress(Console(file=out), enabled=False, clock=lambda: 0.0)
    with progress, progress.task("train reverse", 4) as advance:
        for _ in range(4):
            advance(0.5)
    assert out.getvalue() == ""


def test_the_fixed_size_probes_are_the_general_probes() -> None:
    assert set(bounds.FIXED_SIZE_PROBES) == set(GENERAL_PROBES)


def test_the_estimate_covers_what_built_in_tasks_really_build() -> None:
    """Bytes per example measured on a small n for every built-in task: the task as built and
    its encoded training set stay under the constants the estimate uses."""
    tokenizer, n = build_char_tokenizer(), 300
    for name in [t for t in known_task_names() if t not in GENERAL_PROBES]:
        tracemalloc.start()
        task = build_builtin_task(name, n_train=n, n_eval=20, seed=0)
        built = tracemalloc.get_traced_memory()[1] / (len(task.train) + len(task.eval))
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        features, _ = encode_training_set(tokenizer, task.train, 512, name)
        encoded = (tracemalloc.get_traced_memory()[1] - before) / len(features)
        tracemalloc.stop()
        longest = max(len(f["input_ids"]) for f in features)
        assert longest <= bounds.BUILTIN_TOKENS, name
        assert built <= bounds.EXAMPLE_BYTES, (name, built)
        assert encoded <= bounds.feature_bytes(longest), (name, encoded)
