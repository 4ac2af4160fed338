"""Property-based fuzzing of configs through ``--set``: a run either exits 0 with a coherent
``results.json``, or exits non-zero with one line and leaves the output folder as it was (a run
stopped mid-training leaves a coherent, unfinished ``results.json`` recording why)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import tiny_run_config
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from rich.console import Console

from forgetless.cli.app import run_cli
from forgetless.config.loading import load_config
from forgetless.training.results import Results
from forgetless.training.runner import Runner

KEYS = [
    "seed",
    "train.steps",
    "train.lr",
    "train.batch_size",
    "train.max_length",
    "train.epochs",
    "train.grad_accum",
    "train.scheduler",
    "train.on_nonfinite",
    "train.max_grad_norm",
    "train.weight_decay",
    "eval.n_eval",
    "eval.batch_size",
    "tasks",
    "tasks.0",
    "tasks.0.name",
    "probes",
    "method",
    "method.name",
    "finetune.mode",
    "finetune.lora.r",
]
VALUES = [
    "yes",
    "on",
    "true",
    "null",
    ".inf",
    "-.inf",
    ".nan",
    "0",
    "-1",
    "1",
    "2",
    "0.5",
    "1e-3",
    "1.0e30",
    "1180591620717411303424",
    "[]",
    "[reverse]",
    "[reverse, reverse]",
    "[copy]",
    "{}",
    "abc",
    "../x",
    "rev[/x]",
    "''",
    "lora",
    "cosine",
    "skip",
    "replay",
    "[{builtin: reverse, name: ../../x}]",
]
COUNTS = {"train.steps", "train.grad_accum", "eval.n_eval", "train.epochs", "finetune.lora.r"}
PLAUSIBLE = ["1", "2", "3", "0.01", "1e-4", "cosine", "skip", "seq_ft", "replay", "full", "[sort]"]
"""Values a user would mean: a share of the examples trains, so the success path is fuzzed too."""
JUNK = st.text(alphabet="abc[]{}:/.-_ ", max_size=8)
VALUE = st.one_of(st.sampled_from(PLAUSIBLE), st.sampled_from(VALUES), JUNK)
OVERRIDES = st.lists(st.tuples(st.sampled_from(KEYS), VALUE), min_size=1, max_size=2)
FUZZ = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _config(model_dir: Path, folder: Path) -> Path:
    data = tiny_run_config(
        model_dir,
        tasks=["reverse"],
        probes=[],
        train={"steps": 1, "batch_size": 4, "lr": 1e-3, "max_length": 32},
        eval={"n_eval": 2, "n_train": 8, "batch_size": 8, "kl_drift": False},
    )
    path = folder / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def _snapshot(folder: Path) -> dict[str, bytes]:
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _run(config: Path, out: Path, overrides: list[tuple[str, str]], capsys: Any) -> tuple[int, str]:
    sets = [a for key, value in overrides for a in ("--set", f"{key}={value}")]
    code = run_cli(["run", str(config), "--out", str(out), "--quiet", *sets])
    return code, capsys.readouterr().err.strip()


def _sane(overrides: list[tuple[str, str]]) -> bool:
    """Budgets too large to finish (a fuzz run must end): left out, not an error."""
    return not any(k in COUNTS and v.isdigit() and int(v) > 8 for k, v in overrides)


def _one_line_failure(err: str, overrides: list[tuple[str, str]]) -> None:
    assert err.count("\n") == 0 and err, f"{overrides}: not one line: {err!r}"
    assert "Traceback" not in err and "internal error" not in err, f"{overrides}: {err}"


def _coherent(out: Path, finished: bool) -> None:
    results = Results.read(out / "results.json")  # raises on a foreign or ragged file
    data = results.to_json()
    assert (data["status"] == "complete") == finished
    assert len(results.accuracy) == results.completed_tasks + 1


@FUZZ
@given(overrides=OVERRIDES)
def test_fuzzed_overrides_on_a_fresh_folder(
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    overrides: list[tuple[str, str]],
) -> None:
    assume(_sane(overrides))
    root = tmp_path_factory.mktemp("fuzz")
    out = root / "out"
    code, err = _run(_config(tiny_model_dir, root), out, overrides, capsys)
    if code == 0:
        _coherent(out, finished=True)
        return
    _one_line_failure(err, overrides)
    if out.exists():  # a stop during training: recorded, never "complete"
        _coherent(out, finished=False)
        assert Results.read(out / "results.json").events, f"{overrides}: no event recorded"


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("fuzz-finished")
    config = _config(tiny_model_dir, root)
    Runner(load_config(config), root / "out", Console(quiet=True), progress=False).run()
    return root


@settings(FUZZ, max_examples=15)
@given(overrides=OVERRIDES)
def test_fuzzed_overrides_on_a_finished_run(
    finished: Path,
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    overrides: list[tuple[str, str]],
) -> None:
    assume(_sane(overrides))
    out = shutil.copytree(finished / "out", tmp_path_factory.mktemp("resume") / "out")
    before = _snapshot(out)
    code, err = _run(finished / "fuzz.yaml", out, overrides, capsys)
    if code == 0:
        _coherent(out, finished=True)
        return
    _one_line_failure(err, overrides)
    assert _snapshot(out) == before, f"{overrides}: the folder changed"
