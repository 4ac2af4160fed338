"""Checks and defaults fit for a real model, on tiny models (issue 51): max_length against the
model's positions and the data, the device, the learning rate's advice, probe files used whole,
lm-eval chance, column errors and mapping, "did you mean", the hub offline, dropped chat turns
and the documented task fields."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config, write_jsonl
from rich.console import Console

from forgetless.config.loading import validate_config
from forgetless.config.schema import EvalConfig, HFSource, JsonlSource, TaskConfig
from forgetless.errors import ConfigError, DataError, ModelLoadError
from forgetless.models.tiny import build_char_tokenizer
from forgetless.tasks.base import Example, Task
from forgetless.tasks.loaders import build_task
from forgetless.training.runner import Runner

LONG_ANSWER = "abcdefghij" * 9  # 90 characters: more than the old default max_length of 64


def _run(cfg: dict[str, Any], out: Path) -> tuple[str, dict[str, Any]]:
    """Run ``cfg`` into ``out``; what it printed and its results."""
    screen = io.StringIO()
    console = Console(file=screen, width=400, color_system=None)
    results = Runner(validate_config(cfg), out, console, progress=False).run()
    return screen.getvalue(), results.to_json()


def _chat(i: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": f"n{i}?"},
            {"role": "assistant", "content": str(i)},
        ]
    }


@pytest.fixture(scope="module")
def unset_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run that leaves train.max_length unset and trains a long-answer task and a chat task
    with a system turn the tiny model (no chat template) cannot encode."""
    tmp = tmp_path_factory.mktemp("unset")
    long = [{"prompt": f"q{i}=", "completion": LONG_ANSWER} for i in range(12)]
    chat = [_chat(i) for i in range(12)]
    cfg = tiny_run_config(
        tiny_model_dir,
        tasks=[
            {"name": "long", "jsonl": {"train": str(write_jsonl(tmp / "long.jsonl", long))}},
            {"name": "chat", "jsonl": {"train": str(write_jsonl(tmp / "chat.jsonl", chat))}},
        ],
    )
    cfg["train"] = {"steps": 2, "batch_size": 4, "lr": 1e-3}
    screen, results = _run(cfg, tmp / "run")
    return {"screen": screen, "results": results, "longest": len(LONG_ANSWER) + len("q10=") + 1}


# 1. max_length against the model's positions and the data


def test_max_length_over_the_model_positions_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = tiny_run_config(tiny_model_dir)
    cfg["train"]["max_length"] = 200  # the tiny model has 128 positions
    with pytest.raises(ConfigError) as info:
        _run(cfg, tmp_path / "run")
    message = str(info.value)
    assert "train.max_length=200 is more than the model's 128 positions" in message
    assert "\n" not in message


def test_max_length_over_the_tiny_base_is_refused_at_validate() -> None:
    with pytest.raises(ConfigError, match=r"train\.max_length=256 .*model\.tiny\.max_position"):
        validate_config({"tasks": ["reverse"], "train": {"max_length": 256}})
    assert validate_config({"tasks": ["reverse"]}).train.max_length is None


def test_unset_max_length_is_the_longest_example_and_is_printed(
    unset_run: dict[str, Any],
) -> None:
    longest = unset_run["longest"]
    lines = [line for line in unset_run["screen"].splitlines() if line.startswith("max_length")]
    assert lines == [f"max_length: {longest} (longest example; model allows 128)"]
    events = unset_run["results"]["events"]
    assert not [e for e in events if e["type"] == "truncated"]  # 64 would have cut the answers


def test_the_chosen_max_length_is_at_least_64_and_at_most_the_positions() -> None:
    from forgetless.tasks.lengths import choose_max_length

    assert choose_max_length(212, 8192).chosen == (
        "max_length: 212 (longest example; model allows 8192)"
    )
    short = choose_max_length(25, 128)  # short data trains as it did under the old default
    assert short.tokens == 64 and short.chosen is not None and "longest example 25" in short.chosen
    assert choose_max_length(25, 32).tokens == 32
    capped = choose_max_length(9000, 8192)
    assert capped.tokens == 8192 and capped.chosen is not None and "9000" in capped.chosen


def test_the_longest_example_is_measured_as_trained() -> None:
    from forgetless.tasks.formatting import encoded_length

    tokenizer = build_char_tokenizer()
    assert encoded_length(tokenizer, Example("q1=", LONG_ANSWER)) == 3 + len(LONG_ANSWER) + 1


def test_the_written_config_keeps_max_length_unset(unset_run: dict[str, Any]) -> None:
    assert unset_run["results"]["config"]["train"]["max_length"] is None  # resumable as written


# 2. device


def test_device_and_dtype_are_printed_at_start(unset_run: dict[str, Any]) -> None:
    assert "device: cpu (auto), dtype: float32" in unset_run["screen"].splitlines()


def test_a_device_name_is_checked_at_validate() -> None:
    with pytest.raises(ConfigError, match=r"device must be auto, cpu, cuda, cuda:N or mps"):
        validate_config({"tasks": ["reverse"], "device": "gpu"})
    assert validate_config({"tasks": ["reverse"], "device": "cuda:1"}).device == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_unavailable_device_is_refused_in_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = tiny_run_config(tiny_model_dir, device="cuda")
    with pytest.raises(ConfigError, match=r"^device: cuda: no CUDA device is available here"):
        _run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "results.json").exists()


def test_the_device_picker() -> None:
    from forgetless.models.device import pick_device

    cpu = torch.device("cpu")
    assert pick_device("auto", cpu, 1) == cpu
    assert pick_device("cpu", torch.device("cuda", 0), 1) == cpu
    with pytest.raises(ConfigError, match=r"a launch of 2 processes .* leave device auto"):
        pick_device("cpu", cpu, 2)


# 3. learning rate advice on a real model


def _advice_config(mode: str, **train: Any) -> Any:
    return validate_config(
        {
            "model": {"name_or_path": "some/model"},
            "finetune": {"mode": mode},
            "train": train,
            "tasks": ["reverse"],
        }
    )


def test_tiny_defaults_on_a_real_model_get_advice() -> None:
    from forgetless.training.startup import lr_advice

    full = lr_advice(_advice_config("full"), 494_000_000)
    lora = lr_advice(_advice_config("lora"), 494_000_000)
    assert full is not None and "494M parameters" in full and "lr 1e-5 to 2e-5" in full
    assert lora is not None and "LoRA" in lora and "lr 1e-4 to 2e-4" in lora
    assert lr_advice(_advice_config("full"), 1_000_000) is None  # the tiny base's size
    assert lr_advice(_advice_config("full", lr=2e-5), 494_000_000) is None
    assert lr_advice(_advice_config("full", batch_size=8), 494_000_000) is None


def test_the_advice_is_said_once_at_start(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forgetless.training import startup

    monkeypatch.setattr(startup, "REAL_MODEL_PARAMETERS", 0)  # the tiny model stands in
    cfg = tiny_run_config(tiny_model_dir, tasks=["reverse"], probes=[])
    cfg["train"] = {"steps": 1, "max_length": 32}  # lr and batch_size at their defaults
    screen, _ = _run(cfg, tmp_path / "run")
    advice = [line for line in screen.splitlines() if "are the tiny model's defaults" in line]
    assert len(advice) == 1 and "lr 1e-5 to 2e-5" in advice[0]
    assert "max_length:" not in screen  # set in the config: kept, and not announced


# 4. probe files are evaluated whole


def test_a_probe_file_is_all_evaluation_unless_split(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}=", "completion": str(i)} for i in range(30)]
    path = write_jsonl(tmp_path / "probe.jsonl", rows)
    whole = build_task(TaskConfig(jsonl={"train": path}), EvalConfig(), 0, probe=True)
    assert len(whole.eval) == 30 and whole.train == []
    split = TaskConfig(jsonl={"train": path, "eval_fraction": 0.2})
    assert len(build_task(split, EvalConfig(), 0, probe=True).eval) == 6
    assert len(build_task(TaskConfig(jsonl={"train": path}), EvalConfig(), 0).eval) == 3


def test_a_hf_probe_split_is_all_evaluation(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}=", "completion": str(i)} for i in range(20)]
    path = write_jsonl(tmp_path / "probe.jsonl", rows)
    cfg = TaskConfig(hf={"path": "json", "data_files": str(path)})
    assert len(build_task(cfg, EvalConfig(), 0, probe=True).eval) == 20


# 5. lm-eval multiple-choice chance

LM_TASK = """\
task: mixed_mc
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
"""


def test_lm_eval_chance_is_one_over_the_choices(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forgetless.config.evaluation import LmEvalProbe
    from forgetless.eval.evaluator import Evaluator

    rows = [
        {"prompt": f"{i}+1=", "choices": [str(i + 1), "x", "y", "z"][: 3 + i % 2], "label": 0}
        for i in range(4)
    ]
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    (tmp_path / "mixed_mc.yaml").write_text(LM_TASK.format(data=data), encoding="utf-8")
    probe = LmEvalProbe.model_validate(
        {"lm_eval": {"tasks": ["mixed_mc"], "include_path": tmp_path, "include_defaults": False}}
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    evaluator = Evaluator([], tokenizer, lm_probes=[probe], settings=EvalConfig(kl_drift=False))
    row = evaluator.score(model)
    assert row.chance["lmeval:mixed_mc"] == pytest.approx((1 / 3 + 1 / 4) / 2)
    set_by_hand = probe.model_copy(
        update={"lm_eval": probe.lm_eval.model_copy(update={"chance": 0.5})}
    )
    evaluator = Evaluator(
        [], tokenizer, lm_probes=[set_by_hand], settings=EvalConfig(kl_drift=False)
    )
    assert evaluator.score(model).chance["lmeval:mixed_mc"] == 0.5


# 6. column errors and the JSONL column mapping


def test_a_missing_column_names_the_columns_found(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", [{"question": "2+2=", "answer": "4"}])
    with pytest.raises(DataError) as info:
        build_task(TaskConfig(jsonl={"train": path}), EvalConfig(), 0)
    message = str(info.value)
    assert re.search(r"data\.jsonl:1: no column 'prompt'; found: question, answer", message)
    assert "columns:" in message and "\n" not in message


def test_jsonl_columns_map_other_names(tmp_path: Path) -> None:
    from forgetless.config.schema import Columns

    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    source = {"train": path, "columns": {"prompt": "question", "completion": "answer"}}
    task = build_task(TaskConfig(jsonl=source), EvalConfig(), 0)
    assert sorted(e.completion for e in [*task.train, *task.eval]) == sorted(
        str(i + 1) for i in range(10)
    )
    assert JsonlSource.model_validate(source).columns == Columns(
        prompt="question", completion="answer"
    )


# 7. "did you mean"


def test_a_misspelt_method_gets_a_suggestion() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown method 'sae-fd'; known: .*did you mean 'sae_fd'\?"
    ):
        validate_config({"tasks": ["reverse"], "method": "sae-fd"})


def test_a_misspelt_task_gets_a_suggestion() -> None:
    with pytest.raises(
        DataError, match=r"unknown built-in task 'reverze'.*did you mean 'reverse'\?"
    ):
        build_task(TaskConfig(builtin="reverze"), EvalConfig(), 0)


def test_validate_suggests_the_task_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from forgetless.cli.app import run_cli

    config = tmp_path / "c.yaml"
    config.write_text("tasks: [reverze]\n", encoding="utf-8")
    assert run_cli(["validate", str(config)]) == 2
    assert "did you mean 'reverse'?" in capsys.readouterr().err


# 8. the hub offline or out of reach


def _no_download(*args: object, **kwargs: object) -> None:
    raise AssertionError("the hub was asked")


def test_an_uncached_hub_model_offline_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    from forgetless.config.schema import ModelConfig
    from forgetless.models.loading import load_model_and_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", _no_download)
    with pytest.raises(ModelLoadError) as info:
        load_model_and_tokenizer(ModelConfig(name_or_path="nobody/no-such-model"))
    message = str(info.value)
    assert (
        "'nobody/no-such-model' is not a local folder and not in the Hugging Face cache" in message
    )
    assert "HF_HUB_OFFLINE=1 is set" in message and "\n" not in message


def test_an_uncached_hub_model_without_network_fails_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM

    from forgetless.config.schema import ModelConfig
    from forgetless.core import hub
    from forgetless.models.loading import load_model_and_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", _no_download)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"huggingface\.co cannot be reached"):
        load_model_and_tokenizer(ModelConfig(name_or_path="nobody/no-such-model"))
    assert time.perf_counter() - start < 5


def test_an_uncached_hub_dataset_offline_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", _no_download)
    with pytest.raises(DataError, match=r"'nobody/no-such-data' is not a local folder and not in"):
        build_task(TaskConfig(hf=HFSource(path="nobody/no-such-data")), EvalConfig(), 0)


# 9. chat turns a tokenizer cannot template


def test_a_dropped_system_turn_is_a_warning(unset_run: dict[str, Any]) -> None:
    warnings = [line for line in unset_run["screen"].splitlines() if "left out" in line]
    assert len(warnings) == 1
    assert warnings[0].startswith("warning: task 'chat': the system turn of 12 of 12 chat")
    assert "no chat template" in warnings[0]


def test_a_template_that_drops_a_turn_is_found() -> None:
    from forgetless.tasks.chat_turns import dropped_turns_warning

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (  # renders the user and assistant turns only
        "{% for m in messages %}{% if m['role'] != 'system' %}<{{ m['role'] }}>"
        "{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    chat = Example("n1?", "1", messages=tuple(_chat(1)["messages"]))
    task = Task("chat", [chat], [Example("n2?", "2")])
    warning = dropped_turns_warning(task, tokenizer)
    assert warning is not None and "the system turn of 1 of 1 chat examples" in warning
    assert "chat template drops it" in warning


# 10. the documented task fields


def test_own_data_doc_names_every_task_field() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "own-data.md").read_text(encoding="utf-8")
    fields = {
        *TaskConfig.model_fields,
        *JsonlSource.model_fields,
        *HFSource.model_fields,
        "columns: {prompt:",
    }
    missing = sorted(f for f in fields if f not in doc)
    assert not missing, missing
    assert "max_length" in doc and "max_new_tokens" in doc
