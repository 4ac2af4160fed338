"""The continual runner end to end on a tiny model: results, checkpoints, resume, guards, LoRA."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CrashAt, tiny_run_config, write_jsonl
from rich.console import Console
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from forgetless.config.loading import validate_config
from forgetless.contract.method import Capability, StepContext
from forgetless.errors import ConfigError, TrainingError
from forgetless.methods.seq_ft import SeqFT, SeqFTConfig
from forgetless.training.export import checkpoint_model, load_run
from forgetless.training.runner import Runner


def run(model_dir: Path, out: Path, method: Any = None, **overrides: Any) -> dict[str, Any]:
    cfg = validate_config(tiny_run_config(model_dir, **overrides))
    return Runner(cfg, out, Console(quiet=True), progress=False, method=method).run().to_json()


def test_results_file_schema_and_checkpoints(tiny_model_dir: Path, tmp_path: Path) -> None:
    results = run(tiny_model_dir, tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    assert results["status"] == "complete" and results["completed_tasks"] == 2
    assert results["tasks"] == ["reverse", "cipher"] and results["probes"] == ["copy"]
    assert len(results["accuracy_matrix"]) == 3 and all(
        len(r) == 2 for r in results["accuracy_matrix"]
    )
    assert len(results["probe_accuracy"]) == 3
    assert set(results["metrics"]) >= {
        "average_accuracy",
        "bwt",
        "fwt",
        "forgetting",
        "retention",
        "kl_drift",
    }
    assert results["probe_chance"] == [0.0]
    detail = results["metrics"]["probe_retention"]["copy"]
    assert detail["chance"] == 0.0 and detail["drop"] == pytest.approx(
        results["probe_accuracy"][0][0] - results["probe_accuracy"][-1][0]
    )
    assert results["metrics"]["forgetting_since"] == "any"
    # the continuous signal: one finite, non-positive log-likelihood per task and probe and row
    assert [len(r) for r in results["loglik"]] == [2, 2, 2]
    assert [len(r) for r in results["probe_loglik"]] == [1, 1, 1]
    lls = [v for r in results["loglik"] + results["probe_loglik"] for v in r]
    assert all(v <= 0 and v > -50 for v in lls)
    # training a task raises its gold log-likelihood
    assert results["loglik"][1][0] > results["loglik"][0][0]
    drift = results["kl_drift"]
    assert drift["base_to_model"][0] == pytest.approx(0.0, abs=1e-6)
    assert drift["base_to_model"][-1] > 0 and drift["model_to_base"][-1] > 0
    for stats in results["per_task"]:
        assert (
            stats["steps"] == 4 and stats["tokens_per_second"] > 0 and stats["peak_memory_mb"] > 0
        )
    assert (tmp_path / "config.yaml").is_file()
    for name in ["task-01-reverse", "task-02-cipher"]:
        assert (tmp_path / "checkpoints" / name / "model.safetensors").is_file()
    assert not list(tmp_path.rglob(".tmp*"))


@pytest.mark.parametrize(
    "finetune",
    [
        {"mode": "full"},
        {"mode": "lora", "lora": {"regime": "merge", "r": 2}},
        {"mode": "lora", "lora": {"regime": "per_task", "r": 2}},
    ],
)
def test_resume_after_crash_gives_same_matrix(
    tiny_model_dir: Path, tmp_path: Path, finetune: dict[str, Any]
) -> None:
    overrides = {
        "finetune": finetune,
        "tasks": ["reverse", "cipher", "sort"],
        "train": {"steps": 4, "batch_size": 8, "lr": 1e-2, "max_length": 32},
    }
    full = run(tiny_model_dir, tmp_path / "full", **overrides)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_model_dir, tmp_path / "crash", method=CrashAt(task=3, step=2), **overrides)
    partial = json.loads((tmp_path / "crash" / "results.json").read_text())
    assert partial["completed_tasks"] == 2 and partial["status"] == "running"
    resumed = run(tiny_model_dir, tmp_path / "crash", **overrides)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["kl_drift"] == full["kl_drift"]
    if finetune["mode"] == "full":
        a = load_file(str(tmp_path / "full/checkpoints/task-03-sort/model.safetensors"))
        b = load_file(str(tmp_path / "crash/checkpoints/task-03-sort/model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_changed_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    run(tiny_model_dir, tmp_path)
    with pytest.raises(ConfigError, match=r"differs at train\.lr, train\.steps"):
        run(
            tiny_model_dir,
            tmp_path,
            train={"steps": 5, "batch_size": 8, "lr": 1e-2, "max_length": 32},
        )


def test_per_task_adapters_keep_past_ones_frozen(tiny_model_dir: Path, tmp_path: Path) -> None:
    run(
        tiny_model_dir,
        tmp_path,
        finetune={"mode": "lora", "lora": {"regime": "per_task", "r": 2}},
        train={"steps": 4, "batch_size": 8, "lr": 1e-2, "max_length": 32},
    )
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in (ckpts / "task-02-cipher" / "adapters").iterdir()) == [
        "task_1",
        "task_2",
    ]
    first = load_file(str(ckpts / "task-01-reverse/adapters/task_1/adapter_model.safetensors"))
    again = load_file(str(ckpts / "task-02-cipher/adapters/task_1/adapter_model.safetensors"))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert (ckpts / "task-01-reverse/adapters/task_1/adapter_config.json").is_file()
    assert not (ckpts / "task-01-reverse" / "model.safetensors").exists()


def test_carry_trains_one_adapter_and_leaves_base_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    results = run(
        tiny_model_dir,
        tmp_path,
        finetune={"mode": "lora", "lora": {"r": 2}},
        train={"steps": 4, "batch_size": 8, "lr": 1e-2, "max_length": 32},
    )
    ckpts = tmp_path / "checkpoints"
    one = load_file(str(ckpts / "task-01-reverse/adapters/default/adapter_model.safetensors"))
    two = load_file(str(ckpts / "task-02-cipher/adapters/default/adapter_model.safetensors"))
    assert any(not torch.equal(one[k], two[k]) for k in one), "the same adapter keeps training"
    assert results["kl_drift"]["base_to_model"][-1] > 0
    assert not list(ckpts.rglob("model.safetensors")), "no full weights saved under LoRA"
    cfg, _ = load_run(tmp_path)
    model, _ = checkpoint_model(cfg, tmp_path, ["reverse", "cipher"], 2)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.arange(3, 19).view(2, 8)
    with torch.no_grad(), model.disable_adapter():
        torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits)


def test_nan_loss_stops_with_task_step_and_term(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TrainingError, match=r"task 'reverse' step 0: loss term 'task' is nan"):
        run(
            tiny_model_dir,
            tmp_path,
            train={"steps": 2, "batch_size": 8, "lr": 1e-3, "max_length": 32},
            method=_NaNLoss(SeqFTConfig()),
        )


class _NaNLoss(SeqFT):
    capabilities = frozenset({Capability.REPLACE_LOSS})

    def task_loss(self, batch: Any, outputs: Any, ctx: StepContext) -> torch.Tensor:
        return outputs.logits.sum() * float("nan")


def test_llama_chat_jsonl_lora_end_to_end(tiny_llama_chat_dir: Path, tmp_path: Path) -> None:
    """A user's path: a save_pretrained Llama folder with a chat template, chat JSONL, LoRA."""

    def chat(i: int) -> dict[str, Any]:
        return {
            "messages": [
                {"role": "user", "content": f"say {i}"},
                {"role": "assistant", "content": str(i)},
            ]
        }

    data = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(40)])
    plain = write_jsonl(
        tmp_path / "plain.jsonl", [{"prompt": f"x{i}", "completion": f"{i}"} for i in range(40)]
    )
    results = run(
        tiny_llama_chat_dir,
        tmp_path / "out",
        tasks=[
            {"name": "say", "jsonl": {"train": str(data)}},
            {"jsonl": {"train": str(plain)}, "n_eval": 4},
        ],
        probes=[],
        finetune={"mode": "lora", "lora": {"r": 2}},
    )
    assert results["tasks"] == ["say", "plain"] and results["completed_tasks"] == 2
    assert (
        tmp_path / "out/checkpoints/task-02-plain/adapters/default/adapter_model.safetensors"
    ).is_file()


def test_a_finished_run_is_returned_without_loading_the_model_again(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = run(tiny_model_dir, tmp_path)
    on_disk = (tmp_path / "results.json").read_bytes()

    def no_load(self: Runner) -> None:
        raise AssertionError("a finished run loaded its model again")

    monkeypatch.setattr(Runner, "_load_model", no_load)
    console = Console(record=True, width=200, file=io.StringIO())
    cfg = validate_config(tiny_run_config(tiny_model_dir))
    again = Runner(cfg, tmp_path, console, progress=False).run().to_json()
    assert again == first
    assert (tmp_path / "results.json").read_bytes() == on_disk
    assert "nothing to train" in console.export_text()
