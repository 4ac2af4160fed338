"""lm-evaluation-harness probes, offline: a custom task (YAML + JSONL written here), tiny model."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import tiny_run_config
from peft import LoraConfig, get_peft_model
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from forgetless.cli.app import main
from forgetless.config.evaluation import LmEvalSettings
from forgetless.config.loading import validate_config
from forgetless.errors import ConfigError
from forgetless.eval.lm_eval_probe import check_lm_eval_tasks, pick_metric, run_lm_eval_probe
from forgetless.eval.scorers import MultipleChoice
from forgetless.tasks.base import Task
from forgetless.tasks.builtin import build_builtin_task
from forgetless.training.runner import Runner

TASK_YAML = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: prompt
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_local_task(folder: Path, task: Task) -> Path:
    """An lm-eval task over ``task.eval`` whose requests are what forgetless scores."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "tiny_mc.jsonl"
    rows = [
        {"prompt": e.prompt, "choices": list(e.choices or ()), "label": e.label} for e in task.eval
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    (folder / "tiny_mc.yaml").write_text(TASK_YAML.format(data=data), encoding="utf-8")
    return folder


def varied_lengths(task: Task) -> Task:
    """``addmc`` with choices stretched to 1-4x their length, so acc and acc_norm disagree."""
    examples = [
        dataclasses.replace(
            e,
            choices=tuple(c * (1 + i % 4) for i, c in enumerate(e.choices or ())),
            completion=(e.choices or ())[e.label or 0] * (1 + (e.label or 0) % 4),
        )
        for e in task.eval
    ]
    return dataclasses.replace(task, eval=examples)


def settings(folder: Path, **extra: Any) -> LmEvalSettings:
    return LmEvalSettings(tasks=["tiny_mc"], include_path=folder, include_defaults=False, **extra)


def test_pick_metric() -> None:
    results = {"alias": "x", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.25}
    assert pick_metric(results, None, "x") == 0.25  # acc_norm first
    assert pick_metric(results, "acc", "x") == 0.5
    assert pick_metric(results, "acc,none", "x") == 0.5
    with pytest.raises(ConfigError, match=r"no metric f1; has acc,none, acc_norm,none"):
        pick_metric(results, "f1", "x")


def test_missing_extra_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    with pytest.raises(ConfigError) as info:
        run_lm_eval_probe(None, None, settings(tmp_path), 4)  # type: ignore[arg-type]
    assert "pip install 'forgetless[lmeval]'" in str(info.value) and "\n" not in str(info.value)


def test_probe_matches_lm_eval_own_loading_and_our_scorer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    task = varied_lengths(build_builtin_task("addmc", 0, 16, seed=0))
    folder = write_local_task(tmp_path / "tasks", task)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model.train()
    ours = {
        m: run_lm_eval_probe(model, tokenizer, settings(folder, metric=m), 4)["lmeval:tiny_mc"]
        for m in ("acc", "acc_norm")
    }
    assert model.training  # the probe puts the model back as it found it
    # The path of lm-eval's own CLI: it loads the saved model from disk itself.
    from lm_eval.tasks import TaskManager

    reference = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(tiny_model_dir), "device": "cpu", "dtype": "float32"},
        tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        batch_size=4,
        bootstrap_iters=0,
        log_samples=False,
    )["results"]["tiny_mc"]
    assert ours["acc"] == pytest.approx(reference["acc,none"])
    assert ours["acc_norm"] == pytest.approx(reference["acc_norm,none"])
    # ... and forgetless's own multiple-choice scorer sends the same requests.
    mine = MultipleChoice().score(model, tokenizer, task, batch_size=4).metrics
    assert mine == pytest.approx(ours)
    assert ours["acc"] != ours["acc_norm"]  # the data tells the two apart


def test_probe_runs_the_lora_adapters(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    task = varied_lengths(build_builtin_task("addmc", 0, 16, seed=0))
    folder = write_local_task(tmp_path / "tasks", task)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = run_lm_eval_probe(base, tokenizer, settings(folder, metric="acc_norm"), 8)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 2.0)  # a strong adapter that changes the answers
    with_adapter = run_lm_eval_probe(peft_model, tokenizer, settings(folder, metric="acc_norm"), 8)
    expected = MultipleChoice("acc_norm").score(peft_model, tokenizer, task, 8).accuracy
    assert with_adapter["lmeval:tiny_mc"] == pytest.approx(expected)
    assert with_adapter != before


def test_unknown_lm_eval_task_is_a_config_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    folder = write_local_task(tmp_path / "tasks", build_builtin_task("addmc", 0, 2, seed=0))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    bad = LmEvalSettings(tasks=["no_such_task"], include_path=folder, include_defaults=False)
    with pytest.raises(ConfigError, match="lm-eval probe"):
        run_lm_eval_probe(model, tokenizer, bad, 4)


def test_lm_eval_probe_enters_the_probe_matrix(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    folder = write_local_task(tmp_path / "tasks", build_builtin_task("addmc", 0, 8, seed=0))
    probe = {
        "lm_eval": {
            "tasks": ["tiny_mc"],
            "include_path": str(folder),
            "include_defaults": False,
            "limit": 6,
            "metric": "acc",
        }
    }
    cfg = validate_config(
        tiny_run_config(
            tiny_model_dir,
            tasks=["reverse"],
            probes=["copy", probe],
            train={"steps": 2, "batch_size": 4, "lr": 1e-3, "max_length": 32},
        )
    )
    results = Runner(cfg, tmp_path / "run", Console(quiet=True), progress=False).run().to_json()
    assert results["probes"] == ["copy", "lmeval:tiny_mc"]
    assert len(results["probe_accuracy"]) == 2
    for row in results["probe_accuracy"]:
        assert len(row) == 2 and 0.0 <= row[1] <= 1.0
        assert row[1] * 6 == pytest.approx(round(row[1] * 6))  # a share of the 6 documents
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = run_lm_eval_probe(model, tokenizer, cfg.probes[1].lm_eval, 4)  # type: ignore[union-attr]
    assert results["probe_accuracy"][0][1] == base["lmeval:tiny_mc"]


def test_a_misspelt_task_is_named_with_the_closest_lm_eval_knows(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    folder = write_local_task(tmp_path / "tasks", build_builtin_task("addmc", 0, 2, seed=0))
    check_lm_eval_tasks(settings(folder))
    with pytest.raises(ConfigError) as info:
        check_lm_eval_tasks(
            LmEvalSettings(tasks=["tiny_mcc"], include_path=folder, include_defaults=False)
        )
    assert str(info.value) == (
        "lm_eval.tasks: lm-eval has no task 'tiny_mcc' (did you mean 'tiny_mc'?); "
        "`lm-eval ls tasks` lists them"
    )
    with pytest.raises(ConfigError, match=r"lm_eval.include_path: .*nowhere is not a folder"):
        check_lm_eval_tasks(settings(tmp_path / "nowhere"))


def misspelt_probe_config(model_dir: Path, folder: Path) -> dict[str, Any]:
    probe = {
        "lm_eval": {"tasks": ["tiny_mcc"], "include_path": str(folder), "include_defaults": False}
    }
    return tiny_run_config(model_dir, tasks=["reverse"], probes=["copy", probe])


def test_validate_and_run_refuse_a_misspelt_task_before_writing(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("lm_eval")
    folder = write_local_task(tmp_path / "tasks", build_builtin_task("addmc", 0, 2, seed=0))
    raw = misspelt_probe_config(tiny_model_dir, folder)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    monkeypatch.setattr(sys, "argv", ["forgetless", "validate", str(config)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "probes.1: lm_eval.tasks: lm-eval has no task 'tiny_mcc'" in err
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(ConfigError, match=r"probes\.1: lm_eval\.tasks: lm-eval has no task"):
        Runner(validate_config(raw), out, Console(quiet=True), progress=False).run()
    assert sorted(p.name for p in out.iterdir()) == []
