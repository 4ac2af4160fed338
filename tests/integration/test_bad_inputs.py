"""The bad-input catalogue (docs/reliability.md): each bad input is one line naming the place,
exit code 2 at the CLI, and nothing already written is lost."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TINY, CrashAt, tiny_run_config, write_jsonl
from rich.console import Console
from safetensors.torch import save_model

from forgetless.cli.app import main
from forgetless.config.loading import load_config
from forgetless.models.loading import load_tokenizer
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.tasks.base import Example
from forgetless.tasks.formatting import encode_training_set
from forgetless.training.runner import Runner

SMALL = {"steps": 2, "batch_size": 4, "lr": 1e-3, "max_length": 32}
SMALL_EVAL = {"n_eval": 4, "n_train": 16, "batch_size": 8, "kl_drift": False}
RECORDS = [{"prompt": f"q{i}=", "completion": f"a{i}"} for i in range(12)]


def small_config(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    return tiny_run_config(
        model_dir, **{"train": SMALL, "eval": SMALL_EVAL, "probes": [], **overrides}
    )


def write_config(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def invoke(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["forgetless", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return int(exit_info.value.code or 0), capsys.readouterr().err.strip()


def snapshot(folder: Path) -> dict[str, str]:
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# Each case: (command, config path) built from (tmp_path, model dir, finished run), and the text
# that the one-line error must contain. "validate" cases are caught offline, "run" cases by the
# runner before any training (resume cases: before anything is rewritten).
Case = Callable[[Path, Path, Path], tuple[str, Path]]


def _jsonl_task(tmp: Path, model: Path, jsonl: Path, **task: Any) -> Path:
    return write_config(
        tmp / "c.yaml", small_config(model, tasks=[{"jsonl": {"train": str(jsonl)}, **task}])
    )


def _malformed_yaml(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    (tmp / "bad.yaml").write_text("train: {lr: [\n", encoding="utf-8")
    return "validate", tmp / "bad.yaml"


def _not_a_mapping(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    (tmp / "list.yaml").write_text("- reverse\n", encoding="utf-8")
    return "validate", tmp / "list.yaml"


def _unknown_field(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    return "validate", write_config(tmp / "c.yaml", {**small_config(model), "trian": {}})


def _mistyped_field(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    data = small_config(model, train={**SMALL, "lr": "fast"})
    return "validate", write_config(tmp / "c.yaml", data)


def _missing_model(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    return "run", write_config(tmp / "c.yaml", small_config(tmp / "no-such-model"))


def _missing_dataset(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    return "run", _jsonl_task(tmp, model, tmp / "none.jsonl")


def _missing_hub_dataset(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    task = {"hf": {"path": "no-such-user/no-such-dataset"}}  # tests run with the hub offline
    return "run", write_config(tmp / "c.yaml", small_config(model, tasks=[task]))


def _empty_task(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    (tmp / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    return "run", _jsonl_task(tmp, model, tmp / "empty.jsonl")


def _empty_sequence(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    return "validate", write_config(tmp / "c.yaml", small_config(model, tasks=[]))


def _jsonl_not_json(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    path = tmp / "data.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\nnot json\n', encoding="utf-8")
    return "run", _jsonl_task(tmp, model, path)


def _jsonl_lacks_fields(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    path = write_jsonl(tmp / "data.jsonl", [RECORDS[0], {"prompt": "a", "answer": "b"}])
    return "run", _jsonl_task(tmp, model, path)


def _prompt_too_long(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    long = [{"prompt": "x" * 40, "completion": "y"} for _ in range(12)]
    return "run", _jsonl_task(tmp, model, write_jsonl(tmp / "long.jsonl", long), name="long")


def _no_pad_no_eos(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    folder = tmp / "model"
    shutil.copytree(model, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("pad_token"), config.pop("eos_token")
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return "run", write_config(tmp / "c.yaml", small_config(folder))


def _lora_targets(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    lora = {"mode": "lora", "lora": {"r": 2, "target_modules": ["q_proj", "qkv_proj"]}}
    return "run", write_config(tmp / "c.yaml", small_config(model, finetune=lora))


def _unknown_method(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    return "validate", write_config(tmp / "c.yaml", small_config(model, method="magic"))


def _unknown_task(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    return "validate", write_config(tmp / "c.yaml", small_config(model, tasks=["reverse", "nope"]))


def _unknown_task_at_run(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    return "run", _unknown_task(tmp, model, done)[1]


def _resume(done: Path, tmp: Path) -> Path:
    shutil.copytree(done, tmp / "out")
    return done.parent / "config.yaml"


def _truncated_weights(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    config = _resume(done, tmp)
    path = tmp / "out/checkpoints/task-01-reverse/model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "run", config


def _corrupted_weights(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    config = _resume(done, tmp)
    path = tmp / "out/checkpoints/task-01-reverse/model.safetensors"
    path.write_bytes(b"\xff" * 16 + path.read_bytes()[16:])
    return "run", config


def _corrupted_method_state(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    config = _resume(done, tmp)
    (tmp / "out/checkpoints/task-01-reverse/method_state.json").write_text("{", encoding="utf-8")
    return "run", config


def _other_model(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    config = _resume(done, tmp)
    other = build_tiny_model(
        TINY.model_copy(update={"intermediate_size": 48}), len(build_char_tokenizer()), seed=0
    )
    save_model(other, str(tmp / "out/checkpoints/task-01-reverse/model.safetensors"))
    return "run", config


def _changed_config(tmp: Path, model: Path, done: Path) -> tuple[str, Path]:
    _resume(done, tmp)
    data = small_config(model, tasks=["reverse", "cipher"], train={**SMALL, "lr": 5e-3, "steps": 3})
    return "run", write_config(tmp / "changed.yaml", data)


CATALOGUE: dict[str, tuple[Case, str]] = {
    "malformed YAML": (_malformed_yaml, "bad.yaml:2:1: invalid YAML"),
    "YAML that is not a mapping": (_not_a_mapping, "the top level must be a mapping, got list"),
    "unknown field": (_unknown_field, "c.yaml: trian: Extra inputs are not permitted"),
    "mistyped field": (_mistyped_field, "c.yaml: train.lr: Input should be a valid number"),
    "missing model path": (_missing_model, "model.name_or_path: no such folder"),
    "missing dataset": (_missing_dataset, "data file not found: "),
    "missing hub dataset": (
        _missing_hub_dataset,
        "dataset 'no-such-user/no-such-dataset' is not a local folder and not in the Hugging "
        "Face cache",
    ),
    "empty task": (_empty_task, "empty.jsonl: no examples"),
    "empty sequence": (_empty_sequence, "tasks: List should have at least 1 item"),
    "JSONL line not JSON": (_jsonl_not_json, "data.jsonl:2: invalid JSON (Expecting value"),
    "JSONL line lacks fields": (
        _jsonl_lacks_fields,
        "data.jsonl:2: no column 'completion'; found: prompt, answer",
    ),
    "prompt longer than max_length": (
        _prompt_too_long,
        "task 'long' example 0: the prompt is 40 tokens, so train.max_length=32 leaves none",
    ),
    "tokenizer without pad or eos": (_no_pad_no_eos, "has neither a pad nor an eos token"),
    "LoRA target the model lacks": (
        _lora_targets,
        "finetune.lora.target_modules: 'qkv_proj' not in the model (its leaf modules: ",
    ),
    "unknown method": (_unknown_method, "unknown method 'magic'; known: "),
    "unknown task (validate)": (_unknown_task, "c.yaml: tasks.1: unknown built-in task 'nope'"),
    "unknown task (run)": (_unknown_task_at_run, "unknown built-in task 'nope'; known: "),
    "truncated safetensors": (
        _truncated_weights,
        "task-01-reverse/model.safetensors: unreadable (Error while deserializing header: "
        "incomplete metadata, file not fully covered); the file is truncated or corrupted",
    ),
    "corrupted safetensors": (
        _corrupted_weights,
        "task-01-reverse/model.safetensors: unreadable (",
    ),
    "corrupted method state": (
        _corrupted_method_state,
        "task-01-reverse/method_state.json: unreadable (",
    ),
    "checkpoint from another model": (
        _other_model,
        "tensor 'model.layers.0.mlp.down_proj.weight' has shape [32, 48], the model's is "
        "[32, 64]: the checkpoint is from another model",
    ),
    "resume with a changed config": (
        _changed_config,
        "config.yaml: stored config differs at train.lr, train.steps; use another --out or "
        "--allow-config-change",
    ),
}


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A two-task run stopped after its first task, to resume from (copied by each case that
    damages it): a resume restores the first task's checkpoint (a finished run loads none)."""
    root = tmp_path_factory.mktemp("stopped")
    tasks = ["reverse", "cipher"]
    config = write_config(root / "config.yaml", small_config(tiny_model_dir, tasks=tasks))
    stop = CrashAt(task=2, step=0)
    with pytest.raises(KeyboardInterrupt):
        Runner(load_config(config), root / "out", Console(quiet=True), False, method=stop).run()
    return root / "out"


@pytest.mark.parametrize("case", list(CATALOGUE))
def test_bad_input_is_one_line_exit_2_and_loses_nothing(
    case: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    stopped_run: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    build, expected = CATALOGUE[case]
    command, config = build(tmp_path, tiny_model_dir, stopped_run)
    out = tmp_path / "out"
    before = snapshot(out)
    args = [command, str(config)] + (["--out", str(out), "--quiet"] if command == "run" else [])
    code, err = invoke(monkeypatch, capsys, *args)
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    assert expected in err, err
    assert "Traceback" not in err
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k in before} == before, "a written file changed"
    if not before:  # a fresh run: no results and no checkpoint were written
        assert not any(k == "results.json" or k.startswith("checkpoints") for k in after)


LOCAL_INPUTS = [
    "missing model path", "missing dataset", "empty task", "JSONL line not JSON",
    "JSONL line lacks fields",
]  # fmt: skip
"""Cases that ``validate`` finds too: it reads local data and the model folder as run does."""


@pytest.mark.parametrize("case", LOCAL_INPUTS)
def test_validate_reads_local_data_and_model_folders_as_run_does(
    case: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    build, expected = CATALOGUE[case]
    _, config = build(tmp_path, tiny_model_dir, tmp_path / "unused")
    code, err = invoke(monkeypatch, capsys, "validate", str(config))
    assert code == 2, err
    assert err.startswith(f"error: {config}: "), err
    assert "\n" not in err and expected in err, err


def test_validate_leaves_hub_ids_to_run(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from forgetless.cli.app import run_cli

    _, config = _missing_hub_dataset(tmp_path, tiny_model_dir, tmp_path)
    data = yaml.safe_load(config.read_text(encoding="utf-8"))
    data["model"]["name_or_path"] = "no-such-org/no-such-model"
    write_config(config, data)
    assert run_cli(["validate", str(config)]) == 0, capsys.readouterr().err


def test_allow_config_change_overrides_the_resume_guard(
    tmp_path: Path,
    tiny_model_dir: Path,
    stopped_run: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, config = _changed_config(tmp_path, tiny_model_dir, stopped_run)
    out = tmp_path / "out"
    monkeypatch.setattr(
        sys,
        "argv",
        ["forgetless", "run", str(config), "--out", str(out), "--quiet", "--allow-config-change"],
    )
    main()
    assert "results: " in capsys.readouterr().out
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["lr"] == 5e-3


def test_tokenizer_without_pad_falls_back_to_eos(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_model_dir, tmp_path / "model")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    del config["pad_token"]
    config_path.write_text(json.dumps(config), encoding="utf-8")
    tokenizer = load_tokenizer(str(folder), load_config(None).model)
    assert tokenizer.pad_token == "<eos>" and tokenizer.pad_token_id == tokenizer.eos_token_id


def test_truncation_is_counted_warned_and_recorded(tiny_model_dir: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir), load_config(None).model)
    examples = [Example("p" * 10, "c" * 30), Example("p", "c"), Example("p" * 20, "c" * 5)]
    features, cut = encode_training_set(tokenizer, examples, 24, "task 't'")
    assert cut == 2
    assert [len(f["input_ids"]) for f in features] == [24, 3, 24]
    head = features[0]["input_ids"][10:]
    assert features[0]["labels"][10:] == head, "the completion's head stays"
    records = [{"prompt": "p" * 20, "completion": "c" * 20}] * 6 + RECORDS
    data = write_jsonl(tmp_path / "some-long.jsonl", records)
    config = write_config(
        tmp_path / "c.yaml",
        small_config(tiny_model_dir, tasks=[{"jsonl": {"train": str(data)}, "name": "t"}]),
    )
    console = Console(record=True, width=200)
    results = Runner(load_config(config), tmp_path / "out", console, progress=False).run()
    (event,) = results.events
    assert event["type"] == "truncated" and event["task"] == "t" and event["max_length"] == 32
    assert (event["count"], event["of"]) == (6, 16)  # 2 of the 18 records are held out for eval
    text = console.export_text()
    assert text.count("warning: task 't': ") == 1 and "exceed train.max_length=32" in text
