"""The Evaluator alone: scores a model on probes without a run folder, and agrees with a run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from forgetless.config.loading import validate_config
from forgetless.config.schema import EvalConfig, ModelConfig
from forgetless.eval.evaluator import Evaluator
from forgetless.models.loading import load_model_and_tokenizer
from forgetless.tasks.builtin import build_builtin_task
from forgetless.training.pretrain import shipped_base_dir
from forgetless.training.runner import Runner

PROBES = ("copy", "upper")


@pytest.fixture(scope="module")
def base() -> tuple[torch.nn.Module, object]:
    """The shipped tiny base: it knows the probes (copy, upper), so retention is measurable."""
    folder = shipped_base_dir(ModelConfig())
    assert folder is not None
    model, tokenizer = load_model_and_tokenizer(ModelConfig(), str(folder))
    return model.eval(), tokenizer


def probes() -> list:
    return [build_builtin_task(name, n_train=1, n_eval=16, seed=0) for name in PROBES]


def test_scores_a_model_alone_and_writes_nothing(
    base: tuple[torch.nn.Module, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = base
    monkeypatch.chdir(tmp_path)
    settings = EvalConfig(kl_examples=8, loglik_examples=4, prose=True, prose_paragraphs=2)
    evaluator = Evaluator(probes(), tokenizer, settings=settings, max_length=32)
    evaluator.measure_base(model, score=True)
    assert evaluator.base_row is not None
    row = evaluator.score(model)
    assert set(row.accuracy) == set(PROBES) and all(0 < a <= 1 for a in row.accuracy.values())
    assert row.accuracy == evaluator.base_row.accuracy
    assert row.kl_base_to_model == 0.0 and row.kl_model_to_base == 0.0
    assert row.prose is not None and row.prose["kl_base_to_model"] == pytest.approx(0, abs=1e-6)
    assert set(row.loglik) == set(PROBES)
    kept = row.retention(evaluator.base_row)
    assert all(k.retention == 1.0 for k in kept.values())
    assert list(tmp_path.iterdir()) == []


def test_a_row_says_where_its_time_went(base: tuple[torch.nn.Module, object]) -> None:
    """Each scored set and measure is timed; the parts are disjoint pieces of the row's time."""
    model, tokenizer = base
    settings = EvalConfig(kl_examples=8, loglik_examples=4, prose=True, prose_paragraphs=2)
    evaluator = Evaluator(probes(), tokenizer, settings=settings, max_length=32)
    evaluator.measure_base(model)
    row = evaluator.score(model)
    assert list(row.parts) == [*PROBES, "lm_eval", "loglik", "kl_drift", "prose"]
    assert all(seconds >= 0 for seconds in row.parts.values())
    assert row.parts["copy"] > 0 and row.parts["loglik"] > 0 and row.parts["prose"] > 0
    assert sum(row.parts.values()) <= row.seconds + 0.01


def test_a_damaged_model_drifts_and_retains_less(base: tuple[torch.nn.Module, object]) -> None:
    model, tokenizer = base
    evaluator = Evaluator(probes(), tokenizer, settings=EvalConfig(kl_examples=8), max_length=32)
    evaluator.measure_base(model, score=True)
    assert evaluator.base_row is not None
    damaged = AutoModelForCausalLM.from_config(model.config)
    damaged.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in damaged.parameters():
            p.add_(0.3 * torch.randn_like(p))
    row = evaluator.score(damaged.eval())
    assert row.kl_base_to_model is not None and row.kl_base_to_model > 0.01
    kept = row.retention(evaluator.base_row)
    assert sum(k.retention or 0 for k in kept.values()) < len(PROBES)


def test_agrees_with_a_runs_rows(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Row 0 of a run is the Evaluator's score of the base; the last row, of the exported
    model after the last task."""
    raw = tiny_run_config(tiny_model_dir, tasks=["reverse"])
    cfg = validate_config(raw)
    out = tmp_path / "run"
    Runner(cfg, out, Console(quiet=True), progress=False).run()
    results = json.loads((out / "results.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tasks = [build_builtin_task("reverse", cfg.eval.n_train, cfg.eval.n_eval, cfg.seed)]
    probe = [build_builtin_task("copy", cfg.eval.n_train, cfg.eval.n_eval, cfg.seed)]
    evaluator = Evaluator(probe, tokenizer, tasks=tasks, settings=cfg.eval, max_length=32)
    evaluator.measure_base(model)
    row = evaluator.score(model, base=True)
    assert [row.accuracy["reverse"]] == results["accuracy_matrix"][0]
    assert [row.accuracy["copy"]] == results["probe_accuracy"][0]
    assert [set(parts) >= {"reverse", "copy", "loglik"} for parts in results["eval_parts"]] == [
        True
    ] * len(results["eval_seconds"])
    assert os.path.isdir(out / "checkpoints" / "task-01-reverse")
