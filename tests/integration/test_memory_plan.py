"""The memory plan (``forgetless validate --memory``): its components on the tiny model equal
hand-computed bytes, the command reads a config.json alone, and the device check's dry run
measures a peak beside each prediction."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from transformers import LlamaConfig

from forgetless.cli.app import main
from forgetless.config.schema import RunConfig, method_config
from forgetless.models.memory_plan import meta_model, plan_method, shape_of

ROOT = Path(__file__).resolve().parents[2]
# The default tiny shape as a Llama: hidden 128, 4 layers, 4 heads of 32, 2 kv heads, MLP 512,
# the 99-character vocabulary, tied embeddings, no biases.
LAYER = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 512 + 2 * 128  # q, o; k, v; MLP; two norms
PARAMS = 4 * LAYER + 99 * 128 + 128  # layers, the tied embedding, the final norm
LORA = 4 * 8 * (2 * 256 + 2 * 192 + 3 * 640)  # r 8 on q, o; k, v; gate, up, down per layer
TOKENS = 2 * 16
LAYER_ACTS = (2 * 128 * 4 + 2 * 128 * 4) + (3 * 128 + 2 * 64) * 4 + 4 * 512 * 4  # under LoRA
NORM_WEIGHT_INPUTS = 2 * 128 * 4  # what the norms' trained weights multiply (full)
ACTS = TOKENS * (4 * LAYER_ACTS + 128 * 8 + 99 * 16)  # layers, embedding + final norm, logits
FULL_ACTS = ACTS + TOKENS * 4 * NORM_WEIGHT_INPUTS


def tiny_run(method: str = "seq_ft", mode: str = "full") -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"tiny": {"arch": "llama"}},
            "finetune": {"mode": mode},
            "train": {"batch_size": 2, "max_length": 16},
            "tasks": ["reverse", "cipher"],
            "method": method,
        }
    )


def planned(method: str, mode: str = "full", checkpointing: bool = False) -> Any:
    run = tiny_run(method, mode)
    return plan_method(shape_of(meta_model(run), run), run, run.method, checkpointing)


def test_full_fine_tuning_components_equal_hand_counts() -> None:
    plan = planned("seq_ft")
    assert (plan.weights, plan.gradients, plan.optimizer) == (4 * PARAMS, 4 * PARAMS, 8 * PARAMS)
    assert plan.method_state == 0
    assert plan.activations == FULL_ACTS
    assert plan.peak == 16 * PARAMS  # the gradients outweigh these activations


def test_the_peak_holds_the_larger_of_activations_and_gradients() -> None:
    plan = planned("seq_ft", "lora")
    assert plan.activations > plan.gradients
    assert plan.peak == plan.weights + plan.optimizer + plan.activations


def test_lora_trains_only_adapters_in_float32() -> None:
    plan = planned("seq_ft", "lora")
    assert plan.weights == 4 * (PARAMS + LORA)
    assert (plan.gradients, plan.optimizer) == (4 * LORA, 8 * LORA)
    assert plan.activations == ACTS


def test_checkpointing_keeps_each_layer_input_and_one_layer() -> None:
    layer = LAYER_ACTS + NORM_WEIGHT_INPUTS
    kept = TOKENS * 128 * 4 * 4 + TOKENS * layer + TOKENS * (128 * 8 + 99 * 16)
    assert planned("seq_ft", checkpointing=True).activations == kept


def test_method_state_follows_each_method() -> None:
    assert planned("ewc").method_state == 2 * 4 * PARAMS  # Fisher and anchor
    assert planned("ewc", "lora").method_state == 2 * 4 * LORA
    kl = TOKENS * 99 * (4 + 16)  # reference logits; log-softmaxes, probabilities, gradient
    for name in ("kl_sft", "asft"):
        assert planned(name, "lora").method_state == kl  # adapters switched off: no copy
        assert planned(name).method_state == 4 * PARAMS + kl
    assert planned("replay").method_state == 200 * 16 * 3 * 8
    assert planned("freeze").gradients == 4 * LAYER  # the top layer alone trains


def test_sae_fd_anchor_rows_join_the_batch() -> None:
    plain, sae_fd = planned("seq_ft"), planned("sae_fd")  # 2 rows + ceil(0.25 x 2) anchors
    assert sae_fd.activations == plain.activations * 3 / 2


def test_a_method_declares_its_own_state(monkeypatch: pytest.MonkeyPatch) -> None:
    from forgetless.contract.method import method_class

    cls = method_class("dft")
    monkeypatch.setattr(cls, "memory_state", classmethod(lambda c, *a: 1234.0), raising=False)
    assert planned("dft").method_state == 1234


def write_config_only(folder: Path) -> Path:
    folder.mkdir()
    LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(folder)
    return folder


def run_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["forgetless", *args])
    try:
        main()
    except SystemExit as exit_info:
        return int(exit_info.code or 0)
    return 0


def test_validate_memory_reads_a_config_json_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_config_only(tmp_path / "model")
    config = tmp_path / "run.yaml"
    raw = {"model": {"name_or_path": str(model)}, "tasks": ["reverse"], "method": "ewc"}
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    code = run_cli(monkeypatch, "validate", str(config), "--memory", "--methods", "seq_ft,kl_sft")
    out = capsys.readouterr().out
    assert code == 0, out
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]  # no weights to read
    expected = shape_of(meta_model(RunConfig.model_validate(raw)), RunConfig.model_validate(raw))
    assert f"{expected.params:,} parameters" in out
    assert out.count("seq_ft") == 2 and out.count("kl_sft") == 2  # checkpointing off and on
    assert "ewc" not in out.split("parameters", 1)[1]  # --methods replaces the config's


def test_validate_memory_refuses_an_unknown_method(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"tasks": ["reverse"]}), encoding="utf-8")
    code = run_cli(monkeypatch, "validate", str(config), "--memory", "--methods", "ewk")
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "--methods" in err and "'ewc'" in err


def test_method_config_defaults_plan_like_the_run_method() -> None:
    run = tiny_run("ewc")
    shape = shape_of(meta_model(run), run)
    assert plan_method(shape, run, method_config("ewc")) == plan_method(shape, run, run.method)
