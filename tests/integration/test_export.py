"""``forgetless export``: a run's model after any task as a plain transformers folder, LoRA
folded in, equal in its logits to the model the run holds; never over an existing folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from forgetless.cli.app import app
from forgetless.config.loading import validate_config
from forgetless.errors import ConfigError
from forgetless.training.export import (
    RunFolderError,
    checkpoint_model,
    export_model,
    load_run,
)
from forgetless.training.runner import Runner, load_tasks


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw: dict[str, Any] = tiny_run_config(
        tiny_model_dir, finetune={"mode": "lora", "lora": {"r": 4, "regime": "carry"}}
    )
    raw["train"]["lr"] = 5e-2  # large enough that the adapters move the logits visibly
    out = tmp_path_factory.mktemp("export") / "run"
    Runner(validate_config(raw), out, Console(quiet=True), progress=False).run()
    return out


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("task", [1, 2])
def test_export_equals_the_runs_model(lora_run: Path, tmp_path: Path, task: int) -> None:
    cfg, _ = load_run(lora_run)
    names = [t.name for t in load_tasks(cfg.tasks, cfg)]
    held, _ = checkpoint_model(cfg, lora_run, names, task)
    base, _ = checkpoint_model(cfg, lora_run, names, 0)
    record = export_model(lora_run, tmp_path / "m", task)
    assert record["after_task"] == task and record["lora_folded_in"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert not any("lora" in name for name, _ in loaded.named_parameters())
    ids = torch.randint(3, 60, (2, 12))
    torch.testing.assert_close(_logits(loaded, ids), _logits(held, ids), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(_logits(loaded, ids), _logits(base, ids), atol=1e-3)
    assert AutoTokenizer.from_pretrained(tmp_path / "m").vocab_size > 0
    assert json.loads((tmp_path / "m" / "export.json").read_text())["task"] == names[task - 1]
    assert list((tmp_path / "m").glob("*.safetensors"))


def test_export_refuses_an_existing_folder_and_a_bad_task(lora_run: Path, tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not written by forgetless"):
        export_model(lora_run, taken)
    assert (taken / "keep.txt").read_text() == "mine"
    with pytest.raises(RunFolderError, match=r"--task 3 is not a finished task \(1\.\.2\)"):
        export_model(lora_run, tmp_path / "new", 3)
    assert not (tmp_path / "new").exists()


def test_cli_export_one_line(lora_run: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["export", str(lora_run), str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert "after task 2 (cipher) (LoRA folded in)" in " ".join(result.output.split())
    assert "replaced" not in result.output
    again = CliRunner().invoke(app, ["export", str(lora_run), str(tmp_path / "m"), "--task", "1"])
    assert again.exit_code == 0, again.output
    assert "after task 1 (reverse)" in again.output and "is replaced" in again.output
    missing = CliRunner().invoke(app, ["export", str(tmp_path / "nope"), str(tmp_path / "x")])
    assert missing.exit_code != 0


def test_exported_folders_feed_diagnose_circuits(
    lora_run: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    export_model(lora_run, tmp_path / "after-2")
    args = [str(tiny_model_dir), str(tmp_path / "after-2"), "--behaviour", "reverse"]
    out = tmp_path / "circuits.json"
    result = CliRunner().invoke(
        app, ["diagnose", "circuits", *args, "--n", "4", "--steps", "3", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows][1] == "after-2" and rows[1]["retention"] is not None


def test_circuit_behaviours_include_the_instruct_tasks() -> None:
    from forgetless.diagnostics.diagnose_circuits import behaviour_task

    task, corrupt = behaviour_task("it-json", 4, 0)
    assert task.name == "it-json" and len(task.eval) == 4 and len(corrupt) == 4
    assert all(e.completion.startswith('{"animal": ') for e in task.eval)
