from __future__ import annotations

from pathlib import Path

import pytest
from conftest import write_jsonl

from forgetless.config.schema import EvalConfig, TaskConfig
from forgetless.errors import DataError
from forgetless.tasks.loaders import build_task, read_jsonl

RECORDS = [{"prompt": f"q{i}=", "completion": f"a{i}"} for i in range(20)]


def test_jsonl_prompt_completion_and_split(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", RECORDS)
    task = build_task(
        TaskConfig(jsonl={"train": path, "eval_fraction": 0.25}), EvalConfig(), seed=0
    )
    assert task.name == "qa"
    assert len(task.eval) == 5 and len(task.train) == 15
    assert not {e.prompt for e in task.eval} & {e.prompt for e in task.train}


def test_jsonl_chat_messages(tmp_path: Path) -> None:
    record = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
    }
    (example,) = read_jsonl(write_jsonl(tmp_path / "chat.jsonl", [record]))
    assert example.prompt == "hi" and example.completion == "hello"
    assert example.messages is not None and len(example.messages) == 3


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a", "completion": ', r"bad.jsonl:2: invalid JSON"),
        ('{"prompt": "a"}', r"bad.jsonl:2: no column 'completion'; found: prompt"),
        ("[1, 2]", r"bad.jsonl:2: expected an object"),
        (
            '{"messages": [{"role": "user", "content": "x"}]}',
            r"bad.jsonl:2: the last message must be",
        ),
    ],
)
def test_broken_jsonl_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok=", "completion": "1"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=message):
        read_jsonl(path)


def test_missing_data_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data file not found"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_hf_dataset_from_local_json_with_column_mapping(tmp_path: Path) -> None:
    records = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "hf.jsonl", records)
    cfg = TaskConfig(
        hf={
            "path": "json",
            "data_files": str(path),
            "prompt_column": "question",
            "completion_column": "answer",
            "eval_fraction": 0.2,
        },
        name="hfqa",
    )
    task = build_task(cfg, EvalConfig(), seed=0)
    assert task.name == "hfqa" and len(task.eval) == 2 and len(task.train) == 8
    assert task.train[0].prompt.startswith("q")


def test_hf_dataset_saved_to_disk(tmp_path: Path) -> None:
    import datasets

    ds = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(RECORDS[:12]),
            "test": datasets.Dataset.from_list(RECORDS[12:]),
        }
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    cfg = TaskConfig(hf={"path": str(tmp_path / "ds"), "eval_split": "test"})
    task = build_task(cfg, EvalConfig(), seed=0)
    assert len(task.train) == 12 and len(task.eval) == 8


def test_builtin_caps_and_unknown_builtin() -> None:
    task = build_task(TaskConfig(builtin="reverse", n_train=10, n_eval=3), EvalConfig(), seed=0)
    assert len(task.train) == 10 and len(task.eval) == 3
    with pytest.raises(DataError, match="unknown built-in task 'nope'"):
        build_task(TaskConfig(builtin="nope"), EvalConfig(), seed=0)


def test_a_file_cut_by_eval_n_train_is_said_with_the_place_to_change(tmp_path: Path) -> None:
    from forgetless.config.loading import validate_config
    from forgetless.training.task_data import load_tasks

    path = str(write_jsonl(tmp_path / "qa.jsonl", RECORDS))
    cfg = validate_config(
        {
            "tasks": [
                "reverse",
                {"jsonl": {"train": path}},
                {"name": "own", "jsonl": {"train": path}, "n_train": 4},
                {"name": "small", "jsonl": {"train": path}, "n_train": 50},
            ],
            "eval": {"n_train": 8, "n_eval": 2},
        },
        "test",
    )
    said: list[str] = []
    tasks = load_tasks(cfg.tasks, cfg, said.append)
    assert [len(t.train) for t in tasks] == [8, 8, 4, 18]
    assert [line for line in said if line.startswith("note:")] == [
        "note: task 'qa' trains on the first 8 of its 18 rows (eval.n_train caps a task without "
        "its own n_train: raise it, or set tasks.1.n_train)"
    ]
    as_probes: list[str] = []  # a probe is scored, not trained: its cut is not news
    load_tasks(cfg.tasks, cfg, as_probes.append, probes=True)
    assert not [line for line in as_probes if line.startswith("note:")]


def test_a_file_too_small_to_split_is_named(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "one.jsonl", RECORDS[:1])
    with pytest.raises(DataError, match=r"one\.jsonl: 1 example\(s\), too few to split off"):
        build_task(TaskConfig(jsonl={"train": path}), EvalConfig(), seed=0)
