"""Bad input at the command line: one line naming the place, exit code 2, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import tiny_run_config

from forgetless.cli.app import main


def invoke(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["forgetless", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err.strip()
    return int(exit_info.value.code or 0), err


def write_config(path: Path, data: dict) -> Path:  # type: ignore[type-arg]
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def _cases(tmp_path: Path, model_dir: Path) -> dict[str, tuple[Path, str]]:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n', encoding="utf-8")
    malformed = tmp_path / "malformed.yaml"
    malformed.write_text("train: {lr: [\n", encoding="utf-8")
    return {
        "malformed": (malformed, "malformed.yaml:"),
        "bad_field": (
            write_config(tmp_path / "f.yaml", tiny_run_config(model_dir, train={"lr": -1})),
            "train.lr",
        ),
        "broken_jsonl": (
            write_config(
                tmp_path / "j.yaml",
                tiny_run_config(model_dir, tasks=[{"jsonl": {"train": str(broken)}}]),
            ),
            "broken.jsonl:2: invalid JSON",
        ),
        "unknown_method": (
            write_config(tmp_path / "m.yaml", tiny_run_config(model_dir, method={"name": "nope"})),
            "unknown method 'nope'",
        ),
        "missing_model": (
            write_config(tmp_path / "p.yaml", tiny_run_config(tmp_path / "no-such-model")),
            "model.name_or_path: no such folder",
        ),
    }


@pytest.mark.parametrize(
    "case", ["malformed", "bad_field", "broken_jsonl", "unknown_method", "missing_model"]
)
def test_bad_input_is_one_line_exit_2_and_no_results(
    case: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config, expected = _cases(tmp_path, tiny_model_dir)[case]
    out = tmp_path / "out"
    code, err = invoke(monkeypatch, capsys, "run", str(config), "--out", str(out), "--quiet")
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err and expected in err
    assert not (out / "results.json").exists()


def test_validate_runs_nothing(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = write_config(tmp_path / "ok.yaml", tiny_run_config(tiny_model_dir))
    monkeypatch.setattr(sys, "argv", ["forgetless", "validate", str(config)])
    main()
    assert "ok:" in capsys.readouterr().out
    code, err = invoke(monkeypatch, capsys, "validate", str(config), "--set", "method.name=nope")
    assert code == 2 and "unknown method" in err


@pytest.mark.parametrize(
    ("flag", "override", "expected"),
    [
        ("--fsdp", "method.name=rl", "method 'rl' does not run sharded (FSDP2): it trains through"),
        (
            "--fsdp",
            "finetune={mode: lora, lora: {regime: merge}}",
            "finetune.lora.regime merge does not run sharded (FSDP2)",
        ),
        (
            "--fsdp",
            "method={name: attribution_gate, gate: gradient}",
            "method 'attribution_gate' does not run sharded (FSDP2): it scales gradients",
        ),
        ("--zero", "method.name=rl", "method 'rl' does not run under DeepSpeed ZeRO: it trains"),
        ("--zero", "budget={max_loss: 0.05}", "budget does not run under DeepSpeed ZeRO"),
        (
            "--zero",
            "train.checkpoint_every=2",
            "train.checkpoint_every does not run under DeepSpeed ZeRO",
        ),
    ],
)
def test_validate_refuses_what_cannot_run_sharded_or_through_zero(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flag: str,
    override: str,
    expected: str,
) -> None:
    config = write_config(tmp_path / "ok.yaml", tiny_run_config(tiny_model_dir))
    monkeypatch.setattr(sys, "argv", ["forgetless", "validate", str(config), flag])
    main()
    assert "ok:" in capsys.readouterr().out  # seq_ft, full fine-tuning: runs either way
    code, err = invoke(monkeypatch, capsys, "validate", str(config), flag, "--set", override)
    assert code == 2 and expected in err and "\n" not in err, err


def test_listing_commands(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for command, expected in [("methods", "seq_ft"), ("tasks", "wordprob")]:
        monkeypatch.setattr(sys, "argv", ["forgetless", command])
        main()
        assert expected in capsys.readouterr().out


def _commands(group: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    for name, command in getattr(group, "commands", {}).items():
        yield prefix + name, command.help or ""
        yield from _commands(command, f"{prefix}{name} ")


def test_every_command_says_what_it_does_in_one_line() -> None:
    """A command's first help paragraph is what the listing prints beside its name: one line,
    since the listing keeps a docstring's line breaks."""
    from typer.main import get_command

    from forgetless.cli.app import app

    listed = dict(_commands(get_command(app)))
    assert {"run", "check", "export", "diagnose circuits", "sae eval"} <= set(listed)
    broken = [name for name, text in listed.items() if "\n" in text.strip().split("\n\n")[0]]
    assert not broken, f"commands whose summary spans lines: {broken}"


def test_methods_listing_marks_the_experimental_corner_without_warning() -> None:
    """Listing is not using: no ExperimentalWarning on stderr, and GCWM is marked instead."""
    done = subprocess.run(
        [sys.executable, "-m", "forgetless", "methods"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        check=True,
    )
    assert "ExperimentalWarning" not in done.stderr, done.stderr
    assert "gcwm (experimental)" in done.stdout
    assert "SFT + static KL to the base model" in done.stdout


def test_run_takes_a_thread_count(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run --threads N` (a busy or shared machine) is what the run's runtime records."""
    import json

    import torch

    from forgetless.cli.app import run_cli

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # so that the run's 1 comes from the option
    config = write_config(tmp_path / "c.yaml", tiny_run_config(tiny_model_dir, tasks=["reverse"]))
    try:
        code = run_cli(
            ["run", str(config), "--out", str(tmp_path / "r"), "--quiet", "--threads", "1"]
        )
        assert code == 0, capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
    runtime = json.loads((tmp_path / "r" / "results.json").read_text())["runtime"]
    assert runtime["threads"] == 1


def test_report_reads_a_budgeted_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run's grouped metrics (a budget's summary) are rows of their own in its report."""
    from forgetless.cli.app import run_cli
    from forgetless.config.schema import ModelConfig
    from forgetless.training.pretrain import shipped_base_dir

    base = shipped_base_dir(ModelConfig())  # it knows the copy probe the budget keeps
    assert base is not None
    budget = {"max_loss": 0.5, "probe_batch": 8}
    data = tiny_run_config(base, method={"name": "ewc"}, budget=budget)
    config = write_config(tmp_path / "c.yaml", data)
    run = tmp_path / "r"
    assert run_cli(["run", str(config), "--out", str(run), "--quiet"]) == 0, capsys.readouterr()
    assert run_cli(["report", str(run)]) == 0, capsys.readouterr().err
    report = (run / "report.md").read_text(encoding="utf-8")
    assert "| budget: kept_every_task |" in report and "| budget: end_value |" in report
    assert "Each task by its own scorer" in report


def test_forgetless_warnings_print_as_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from forgetless.cli.app import one_line_warnings

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # put back after
    one_line_warnings()
    experimental = type("ExperimentalWarning", (UserWarning,), {"__module__": "forgetless.x"})
    said = warnings.formatwarning("it may change", experimental, "/lib/importlib.py", 126, "x")
    assert said == "warning: it may change\n"
    other = warnings.formatwarning("theirs", FutureWarning, "/lib/peft.py", 3, "x")
    assert "/lib/peft.py:3: FutureWarning: theirs" in other


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--seeds", "0"], "Invalid value for '--seeds'"),
        (["--orders", "-1"], "Invalid value for '--orders'"),
        (["--methods", "seq_ft,seq_ft"], "bench: variant 'seq_ft' is listed twice"),
        (["--methods", ""], "--methods: names no variant"),
    ],
)
def test_a_bench_that_would_run_nothing_or_a_run_twice_is_refused(
    args: list[str],
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "bench"
    code, err = invoke(monkeypatch, capsys, "bench", *args, "--out", str(out), "--quiet")
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not out.exists()


def test_a_config_that_lists_a_variant_twice_fails_validate(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    twice = {"variants": [{"name": "a", "method": {"name": m}} for m in ("seq_ft", "ewc")]}
    config = write_config(tmp_path / "b.yaml", {**tiny_run_config(tiny_model_dir), "bench": twice})
    code, err = invoke(monkeypatch, capsys, "validate", str(config))
    assert code == 2 and "variant 'a' is listed twice" in err, err


def test_a_geometry_rank_below_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = invoke(monkeypatch, capsys, "diagnose", "geometry", str(tmp_path), "--rank", "0")
    assert code == 2 and "Invalid value for '--rank'" in err, err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["circuits", "A", "B", "--temperature", "0"], "'--temperature': 0.0 is not above 0"),
        (["circuits", "A", "B", "--final-temperature", "-1"], "'--final-temperature'"),
        (["circuits", "A", "B", "--lr", "0"], "'--lr': 0.0 is not above 0"),
        (["attribution", "A", "--overlap", "2"], "'--overlap': 2.0 is not in (0, 1)"),
        (["attribution", "A", "--top", "0"], "'--top': 0.0 is not in (0, 1]"),
    ],
)
def test_a_diagnose_option_out_of_range_is_one_line_before_any_work(
    args: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = invoke(monkeypatch, capsys, "diagnose", *args)
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err


@pytest.mark.parametrize(
    ("probes", "expected"),
    [("cpy", "--probes: unknown built-in task 'cpy'"), (",", "--probes: names no probe")],
)
def test_a_drift_probe_no_task_has_is_one_line(
    probes: str,
    expected: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "drift.json"
    args = ["diagnose", "drift", str(tiny_model_dir), str(tiny_model_dir), "--probes", probes]
    code, err = invoke(monkeypatch, capsys, *args, "--out", str(out))
    assert code == 2 and expected in err and "internal error" not in err, err
    assert not out.exists()


def test_a_dataset_path_meant_as_a_local_folder_is_named_missing(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``data/no_such_folder`` where ``data/`` is a folder here is a local path, not a hub id."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    task = {"hf": {"path": "data/no_such_folder"}}
    config = write_config(tmp_path / "h.yaml", tiny_run_config(tiny_model_dir, tasks=[task]))
    code, err = invoke(monkeypatch, capsys, "validate", str(config))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.endswith("tasks.0: dataset 'data/no_such_folder': no such folder"), err


def test_validate_reading_a_local_csv_prints_one_line_and_no_progress_bar(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = tmp_path / "t.csv"
    data.write_text("prompt,completion\na,b\nc,d\n", encoding="utf-8")
    task = {"hf": {"path": "csv", "data_files": str(data), "prompt_column": "q"}}
    config = write_config(tmp_path / "c.yaml", tiny_run_config(tiny_model_dir, tasks=[task]))
    code, err = invoke(monkeypatch, capsys, "validate", str(config))
    assert code == 2 and len(err.splitlines()) == 1 and "no column 'q'" in err, err
    assert "Generating" not in err
