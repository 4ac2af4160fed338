"""ContinualTrainer: a loaded model and in-memory datasets, the same run as `forgetless run`."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import write_jsonl
from datasets import Dataset, DatasetDict
from rich.console import Console

import forgetless
from forgetless.cli.app import run_cli
from forgetless.config.schema import ModelConfig
from forgetless.errors import ConfigError, DataError
from forgetless.models.loading import load_model_and_tokenizer

TRAIN = {"steps": 3, "batch_size": 4, "lr": 1e-3, "max_length": 32}
EVAL = {"n_eval": 6, "batch_size": 8, "kl_examples": 4}


def records(prefix: str, n: int = 16) -> list[dict[str, str]]:
    return [{"prompt": f"{prefix}{i}=", "completion": f"{i % 7}"} for i in range(n)]


def chat(n: int = 16) -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"c{i}?"},
                {"role": "assistant", "content": "ok"},
            ]
        }
        for i in range(n)
    ]


def loaded(model_dir: Path) -> tuple[Any, Any]:
    return load_model_and_tokenizer(ModelConfig(), str(model_dir))


def trainer(model_dir: Path, out: Path, tasks: list[tuple[str, Any]], **kw: Any) -> Any:
    model, tokenizer = loaded(model_dir)
    return forgetless.ContinualTrainer(
        model, tokenizer, tasks, out_dir=out, progress=False, console=Console(quiet=True),
        evaluation=EVAL, **{**TRAIN, **kw},
    )  # fmt: skip


def test_three_in_memory_tasks_one_of_them_chat(
    tiny_llama_chat_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    second = DatasetDict(
        train=Dataset.from_list(records("b")), test=Dataset.from_list(records("b", 6))
    )
    tasks = [("first", Dataset.from_list(records("a"))), ("second", second), ("talk", chat())]
    out = tmp_path / "run"
    results = trainer(tiny_llama_chat_dir, out, tasks, method="ewc").fit()
    data = results.to_json()
    assert data["tasks"] == ["first", "second", "talk"] and data["status"] == "complete"
    assert len(data["accuracy_matrix"]) == 4 and data["config"]["method"]["name"] == "ewc"
    assert (out / "data" / "second.eval.jsonl").is_file()
    again = tmp_path / "again"
    assert run_cli(["run", str(out / "config.yaml"), "--out", str(again), "--quiet"]) == 0, (
        capsys.readouterr().err
    )
    repeated = json.loads((again / "results.json").read_text())
    assert repeated["accuracy_matrix"] == data["accuracy_matrix"]


def test_the_same_sequence_as_forgetless_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    first, second = records("a"), records("b")
    through_trainer = trainer(
        tiny_model_dir, tmp_path / "t", [("first", first), ("second", second)], method="replay"
    ).fit()
    config = {
        "model": {"name_or_path": str(tiny_model_dir)},
        "train": TRAIN,
        "eval": EVAL,
        "method": "replay",
        "tasks": [
            {"name": "first", "jsonl": {"train": str(write_jsonl(tmp_path / "a.jsonl", first))}},
            {"name": "second", "jsonl": {"train": str(write_jsonl(tmp_path / "b.jsonl", second))}},
        ],
    }
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")
    assert run_cli(["run", str(path), "--out", str(tmp_path / "r"), "--quiet"]) == 0
    through_cli = json.loads((tmp_path / "r" / "results.json").read_text())
    assert through_trainer.to_json()["accuracy_matrix"] == through_cli["accuracy_matrix"]
    assert through_trainer.to_json()["metrics"]["bwt"] == through_cli["metrics"]["bwt"]


def test_bad_data_and_names_are_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"tasks: 'x': example 1 is a str, not a record"):
        trainer(
            tiny_model_dir, tmp_path / "a", [("x", [{"prompt": "a", "completion": "b"}, "no"])]
        ).fit()
    with pytest.raises(ConfigError, match=r"tasks: '\.\./up': not usable as a file name"):
        trainer(tiny_model_dir, tmp_path / "b", [("../up", records("a"))]).fit()
    assert not (tmp_path / "up.jsonl").exists()
    with pytest.raises(
        DataError, match=r"^ContinualTrainer: tasks: 'y': row 0: no column 'prompt'; found: "
    ):
        trainer(tiny_model_dir, tmp_path / "c", [("y", [{"question": "a", "answer": "b"}])]).fit()
    bad_chat = [{"messages": [{"role": "human", "content": "hi"}]}]
    with pytest.raises(DataError, match=r"'z' \(eval\): row 0: message 0 has role 'human'"):
        held = {"train": records("a"), "test": bad_chat}
        trainer(tiny_model_dir, tmp_path / "c", [("a", records("a")), ("z", held)]).fit()
    with pytest.raises(DataError, match=r"'w': a mapping of splits needs a 'train' split"):
        trainer(tiny_model_dir, tmp_path / "c", [("w", {"test": records("a")})]).fit()
    with pytest.raises(ConfigError, match=r"probes\.1: unknown built-in task 'copyy'"):
        trainer(tiny_model_dir, tmp_path / "c", [("a", records("a"))], probes=["copy", "copyy"])
    with pytest.raises(ConfigError, match=r"tasks\.0: expected a \(name, data\) pair, got list"):
        trainer(tiny_model_dir, tmp_path / "c", [records("a")])
    with pytest.raises(ConfigError, match=r"tasks: a mapping; give a list of \(name, data\)"):
        trainer(tiny_model_dir, tmp_path / "c", {"a": records("a")})  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()  # every refusal came before anything was written


def test_a_peft_model_trains_its_own_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A PeftModel keeps its adapter (name, rank, targets) and trains only it, in place."""
    from peft import LoraConfig, get_peft_model

    model, tokenizer = loaded(tiny_model_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora, adapter_name="mine")
    base_before = {
        n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" not in n
    }
    tasks = [("first", records("a")), ("second", records("b"))]
    results = forgetless.ContinualTrainer(
        peft_model, tokenizer, tasks, out_dir=tmp_path / "run", progress=False,
        console=Console(quiet=True), evaluation=EVAL, **TRAIN,
    ).fit()  # fmt: skip
    finetune = results.to_json()["config"]["finetune"]
    assert finetune["mode"] == "lora" and finetune["lora"]["regime"] == "carry"
    assert finetune["lora"]["r"] == 4 and finetune["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert list(peft_model.peft_config) == ["mine"]
    trained = dict(peft_model.named_parameters())
    assert any(bool(p.abs().sum() > 0) for n, p in trained.items() if "lora_B.mine" in n)
    assert all(torch.equal(trained[n], before) for n, before in base_before.items())
    assert any((tmp_path / "run").rglob("adapters/mine/adapter_model.safetensors"))


def test_a_peft_model_refuses_full_fine_tuning(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    model, tokenizer = loaded(tiny_model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match="PeftModel trains its own adapter"):
        forgetless.ContinualTrainer(
            peft_model, tokenizer, [("a", records("a"))], finetune="full", out_dir=tmp_path / "r"
        ).config()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*"))}


def test_a_trained_run_refuses_other_data_or_settings_before_writing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The saved data are the record of what the run trained on: checked, never overwritten."""
    out = tmp_path / "run"
    trainer(tiny_model_dir, out, [("first", records("a"))]).fit()
    saved = _files(out / "data")
    with pytest.raises(ConfigError, match=r"first\.jsonl: these data differ from .*first\.jsonl"):
        trainer(tiny_model_dir, out, [("first", records("a", 12))]).fit()
    with pytest.raises(
        ConfigError, match=r"stored config differs at train\.lr; use another out_dir or "
        r"allow_config_change=True"
    ):  # fmt: skip
        trainer(tiny_model_dir, out, [("first", records("a"))], lr=5e-4).fit()
    with pytest.raises(ConfigError, match=r"stored config differs at tasks; use another out_dir"):
        trainer(tiny_model_dir, out, [("first", records("a")), ("new", records("n"))]).fit()
    assert _files(out / "data") == saved
    again = trainer(tiny_model_dir, out, [("first", records("a", 12))], allow_config_change=True)
    events = again.fit().to_json()["events"]
    assert any(e["type"] == "input_changed" for e in events)
    assert _files(out / "data") != saved


def test_a_refused_config_writes_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"train\.lamda"):
        trainer(tiny_model_dir, out, [("first", records("a"))], method="ewc", lamda=3.0).fit()
    assert not out.exists()


def test_a_users_folder_is_refused_by_its_keyword(tiny_model_dir: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"choose a new or empty out_dir$"):
        trainer(tiny_model_dir, mine, [("a", records("a"))]).fit()
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_a_tokenizer_that_loses_text_is_said_and_the_saved_config_runs_anywhere(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    model, _ = loaded(tiny_model_dir)
    wrong = AutoTokenizer.from_pretrained(tiny_model_dir)  # Qwen2Tokenizer: drops spaces
    said = Console(record=True, width=400, file=io.StringIO())
    trainer = forgetless.ContinualTrainer(
        model, wrong, [("a", records("a"))], out_dir=tmp_path / "run", progress=False,
        console=said, evaluation=EVAL, **TRAIN,
    )  # fmt: skip
    trainer.fit()
    assert "gives 'ab cd ef' back as 'abcdef'" in said.export_text()
    saved = trainer.config().tasks[0].jsonl
    assert saved is not None and Path(saved.train).is_absolute()
