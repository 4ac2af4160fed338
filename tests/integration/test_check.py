"""``forgetless check``: the forgetting gate on the tiny suite, and its statistic alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from rich.console import Console

from forgetless.cli.app import run_cli
from forgetless.cli.check import PROSE_PARAGRAPHS
from forgetless.config.loading import validate_config
from forgetless.config.schema import ModelConfig
from forgetless.errors import DataError
from forgetless.eval.gate import ProbeItems, gate
from forgetless.methods.replay import PROSE_HELD_OUT
from forgetless.models.loading import load_model
from forgetless.training.export import export_model
from forgetless.training.pretrain import shipped_base_dir
from forgetless.training.runner import Runner

FAST = ["--n-eval", "32", "--repeats", "500", "--prose-paragraphs", "2"]


@pytest.fixture(scope="module")
def base_dir() -> Path:
    """The shipped tiny base: it knows copy and upper, the probes the gate reads."""
    folder = shipped_base_dir(ModelConfig())
    assert folder is not None
    return folder


@pytest.fixture(scope="module")
def forgetful_dir(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base after a few seq_ft steps on `reverse` at a high learning rate, exported."""
    folder = tmp_path_factory.mktemp("seq_ft")
    cfg = validate_config(
        {
            "model": {"name_or_path": str(base_dir)},
            "train": {"steps": 8, "batch_size": 8, "lr": 1e-2, "max_length": 32},
            "eval": {"n_eval": 4, "n_train": 64, "kl_drift": False, "loglik_examples": 0},
            "tasks": ["reverse"],
            "probes": [],
            "method": "seq_ft",
        }
    )
    Runner(cfg, folder / "run", Console(quiet=True), progress=False).run()
    export_model(folder / "run", folder / "model")
    return folder / "model"


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = run_cli(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_base_passes_against_itself(base_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(base_dir), "--base", str(base_dir), "--probes", "copy,upper"]
    code, out, err = check(capsys, *args, "--max-loss", "0.05", *FAST)
    assert code == 0, err
    assert re.search(r"^all\s+64\s+1\.000\s+\[1\.000, 1\.000\]$", out, re.M), out
    assert re.search(r"^prose: KL\(base \|\| model\) 0\.0000 per token", out, re.M), out
    assert "PASS: loss 0.000, at most 0.000 at 95% confidence <= max-loss 0.050" in out
    assert PROSE_PARAGRAPHS == PROSE_HELD_OUT, "KL on prose that replay-general never trains on"


def test_a_fresh_adapter_is_loaded_onto_the_base_and_passes(
    base_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = load_model(str(base_dir), ModelConfig())
    adapter = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    adapter.save_pretrained(str(tmp_path / "adapter"))  # B = 0: the base itself
    args = [str(tmp_path / "adapter"), "--base", str(base_dir), "--probes", "copy"]
    code, out, err = check(capsys, *args, "--max-loss", "0", *FAST)
    assert code == 0, err
    assert "PASS: loss 0.000" in out


def test_a_model_that_forgot_fails_with_its_interval(
    base_dir: Path, forgetful_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [str(forgetful_dir), "--base", str(base_dir), "--probes", "copy,upper"]
    code, out, err = check(capsys, *args, "--max-loss", "0.2", *FAST)
    assert code == 1, err
    overall = re.search(r"^all\s+64\s+(-?[\d.]+)\s+\[(-?[\d.]+), (-?[\d.]+)\]$", out, re.M)
    assert overall, out
    retention, low, high = (float(g) for g in overall.groups())
    assert low <= retention <= high and low < 0.8
    verdict = re.search(r"^FAIL: loss ([\d.]+), at most ([\d.]+) at 95% confidence > ", out, re.M)
    assert verdict and float(verdict.group(2)) > 0.2, out
    kl = re.search(r"^prose: KL\(base \|\| model\) ([\d.]+) per token", out, re.M)
    assert kl and float(kl.group(1)) > 0.01, out


def test_bad_input_is_one_line_and_exit_2(
    base_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    cases = [
        ([str(missing), "--base", str(base_dir), "--probes", "copy"], "MODEL_OR_ADAPTER: no such"),
        ([str(base_dir), "--base", str(missing), "--probes", "copy"], "--base: no such folder"),
        (
            [str(base_dir), "--base", str(base_dir), "--probes", "nope"],
            "--probes: unknown built-in",
        ),
        (
            [str(base_dir), "--base", str(base_dir), "--probes", str(tmp_path / "p.jsonl")],
            "--probes: data file not found",
        ),
        (
            [str(base_dir), "--base", str(base_dir), "--probes", str(tmp_path / "qa.jsonl")],
            "--probes: "
            + str(
                tmp_path / "qa.jsonl:1: no column 'prompt'; found: question, "
                "answer (check reads the keys prompt and completion)"
            ),
        ),
    ]
    (tmp_path / "qa.jsonl").write_text('{"question": "a", "answer": "b"}\n', encoding="utf-8")
    for args, place in cases:
        code, out, err = check(capsys, *args, "--max-loss", "0.1", *FAST)
        assert code == 2 and err.startswith(f"error: {place}"), (args, err)
        assert err.count("\n") == 1 and not out
    code, _, err = check(capsys, str(base_dir), "--base", str(base_dir), "--probes", "copy")
    assert code == 2 and "--max-loss" in err


def test_a_folder_of_models_says_which_to_give(
    base_dir: Path, forgetful_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run folder points to export; a folder of named adapters lists them."""
    model = load_model(str(base_dir), ModelConfig())
    adapter = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    adapter.save_pretrained(str(tmp_path / "adapters" / "default"))
    run = forgetful_dir.parent / "run"
    cases = [
        (run, f"is a forgetless run folder, not a model; export its model first: "
              f"forgetless export {run} OUT"),
        (tmp_path / "adapters", f"holds adapters by name; give one: {tmp_path}/adapters/default"),
    ]  # fmt: skip
    for folder, says in cases:
        args = [str(folder), "--base", str(base_dir), "--probes", "copy", "--max-loss", "0.1"]
        code, _, err = check(capsys, *args, *FAST)
        assert code == 2 and err.startswith("error: MODEL_OR_ADAPTER: ") and says in err, err


def test_the_gate_statistic_on_hand_made_items() -> None:
    base = [True] * 40
    kept_30 = [i < 30 for i in range(40)]
    verdict = gate([ProbeItems("p", base, kept_30)], max_loss=0.5, repeats=2000, seed=1)
    assert verdict.retention == pytest.approx(0.75) and verdict.loss == pytest.approx(0.25)
    assert verdict.low < 0.75 < verdict.high and verdict.passed
    assert verdict.loss_bound == pytest.approx(1 - verdict.low)
    assert not gate([ProbeItems("p", base, kept_30)], max_loss=0.1, seed=1).passed
    choice = ProbeItems("mc", [i < 30 for i in range(40)], [i < 20 for i in range(40)], 0.25)
    alone = gate([choice], max_loss=1.0, seed=1)
    assert alone.retention == pytest.approx((0.5 - 0.25) / (0.75 - 0.25)), "unclipped, above chance"
    at_chance = ProbeItems("dull", [i < 10 for i in range(40)], [True] * 40, 0.25)
    both = gate([choice, at_chance], max_loss=1.0, seed=1)
    assert both.retention == alone.retention and both.probes[1].retention is None
    better = gate([ProbeItems("p", kept_30, base)], max_loss=0.0, seed=1)
    assert better.retention == pytest.approx(40 / 30) and better.passed, "no clip at 1"
    with pytest.raises(DataError, match="nothing to retain"):
        gate([at_chance], max_loss=0.1)
