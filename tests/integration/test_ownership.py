"""Nothing a user owns is overwritten, and no two runs share a folder (docs/reliability.md,
"Ownership of output folders"): one test matrix over every command that takes ``--out``, atomic
merges under interrupts, and resumes that check what they resume."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import write_jsonl
from rich.console import Console
from safetensors.torch import load_file
from test_bad_inputs import SMALL, snapshot
from test_bad_inputs import small_config as small
from test_bad_inputs import write_config as write_yaml
from test_hostile_inputs import HOLDER

from forgetless.cli.app import run_cli
from forgetless.config.loading import load_config
from forgetless.core import storage
from forgetless.training.runner import Runner

USER_CONFIG = "# my notes\nname: my project\n"


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = run_cli(list(args))
    return code, capsys.readouterr().err.strip()


def one_line(err: str) -> str:
    assert err and "\n" not in err, f"not one line: {err!r}"
    assert "Traceback" not in err and "internal error" not in err
    return err


def user_folder(root: Path) -> Path:
    """A folder of the user's: a project config and a note."""
    folder = root / "project"
    folder.mkdir()
    (folder / "config.yaml").write_text(USER_CONFIG, encoding="utf-8")
    (folder / "notes.txt").write_text("mine", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A finished run on the tiny model: the input of export and the diagnoses."""
    root = tmp_path_factory.mktemp("owned")
    config = write_yaml(root / "run.yaml", small(tiny_model_dir, tasks=["reverse"]))
    Runner(load_config(config), root / "run", Console(quiet=True), progress=False).run()
    return root


def merge_yaml(folder: Path, base: Path) -> Path:
    from transformers import AutoModelForCausalLM

    task = folder / "task-model"
    if not task.exists():
        model = AutoModelForCausalLM.from_pretrained(str(base))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        model.save_pretrained(str(task))
    data = {"base_model": str(base), "tasks": [{"path": str(task)}], "method": {"name": "ties"}}
    return write_yaml(folder / "merge.yaml", data)


# Each command that takes --out: its arguments given the run, the model and a scratch folder.
Command = Callable[[Path, Path, Path], list[str]]


def _run(root: Path, model: Path, tmp: Path) -> list[str]:
    config = write_yaml(tmp / "c.yaml", small(model, tasks=["reverse"]))
    return ["run", str(config), "--quiet", "--out"]


def _bench(root: Path, model: Path, tmp: Path) -> list[str]:
    config = write_yaml(tmp / "c.yaml", small(model, tasks=["reverse"]))
    return ["bench", str(config), "--methods", "seq_ft", "--seeds", "1", "--quiet", "--out"]


def _merge(root: Path, model: Path, tmp: Path) -> list[str]:
    return ["merge", str(merge_yaml(tmp, model)), "--out"]


def _export(root: Path, model: Path, tmp: Path) -> list[str]:
    return ["export", str(root / "run")]


def _pretrain(root: Path, model: Path, tmp: Path) -> list[str]:
    return ["pretrain", "--quiet", "--out"]


def _sae(root: Path, model: Path, tmp: Path) -> list[str]:
    config = write_yaml(tmp / "c.yaml", small(model, tasks=["reverse"]))
    return ["sae", "train", str(config), "--steps", "1", "--quiet", "--out"]


FOLDER_COMMANDS: dict[str, Command] = {
    "run": _run,
    "bench": _bench,
    "merge": _merge,
    "export": _export,
    "pretrain": _pretrain,
    "sae train": _sae,
}


@pytest.mark.parametrize("command", sorted(FOLDER_COMMANDS))
def test_every_out_folder_command_refuses_a_users_folder(
    command: str,
    finished: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = user_folder(tmp_path)
    before = snapshot(target)
    args = FOLDER_COMMANDS[command](finished, tiny_model_dir, tmp_path)
    code, err = cli(capsys, *args, str(target))
    assert code == 2, err
    assert f"{target}: not empty and not written by forgetless" in one_line(err)
    place = "OUT" if command == "export" else "--out"  # as each command's help names it
    assert one_line(err).endswith(f"choose a new or empty {place}"), err
    assert snapshot(target) == before


@pytest.mark.parametrize("command", sorted(FOLDER_COMMANDS))
def test_every_out_folder_command_refuses_another_kinds_folder(
    command: str,
    finished: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A finished run's folder is forgetless's, but only a run may go on in it."""
    if command == "run":
        pytest.skip("a run folder is a run's own (the resume cases below)")
    target = shutil.copytree(finished / "run", tmp_path / "someone-run")
    before = snapshot(target)
    args = FOLDER_COMMANDS[command](finished, tiny_model_dir, tmp_path)
    code, err = cli(capsys, *args, str(target))
    assert code == 2, err
    assert "holds a forgetless run output" in one_line(err)
    assert snapshot(target) == before


def test_run_into_the_folder_of_its_own_config_is_refused(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cd proj; forgetless run config.yaml --out .``: the input keeps its comments."""
    project = tmp_path / "proj"
    project.mkdir()
    text = "# my comments\n" + yaml.safe_dump(small(tiny_model_dir, tasks=["reverse"]))
    (project / "config.yaml").write_text(text, encoding="utf-8")
    monkeypatch.chdir(project)
    code, err = cli(capsys, "run", "config.yaml", "--out", ".", "--quiet")
    assert code == 2 and "holds the input config.yaml" in one_line(err)
    assert (project / "config.yaml").read_text(encoding="utf-8") == text
    assert sorted(p.name for p in project.iterdir()) == ["config.yaml"]


def test_a_runs_own_config_is_never_its_output(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = shutil.copytree(finished / "run", tmp_path / "run")
    before = snapshot(run)
    code, err = cli(capsys, "run", str(run / "config.yaml"), "--out", str(run), "--quiet")
    assert code == 2 and "is the input" not in err and "holds the input" in one_line(err)
    assert snapshot(run) == before


@pytest.mark.parametrize("invalid", [False, True])
def test_run_into_a_folder_with_a_users_config_is_refused(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], invalid: bool
) -> None:
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "config.yaml").write_text(
        "train: {lr: [\n" if invalid else "name: my project\n", encoding="utf-8"
    )
    before = snapshot(folder)
    config = write_yaml(tmp_path / "one.yaml", small(tiny_model_dir, tasks=["reverse"]))
    code, err = cli(capsys, "run", str(config), "--out", str(folder), "--quiet")
    assert code == 2 and "not written by forgetless" in one_line(err)
    assert snapshot(folder) == before


def test_a_new_or_empty_folder_is_claimed_and_resumed(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    config = write_yaml(tmp_path / "one.yaml", small(tiny_model_dir, tasks=["reverse"]))
    for _ in range(2):  # the second call finds its own finished run
        code, err = cli(capsys, "run", str(config), "--out", str(empty), "--quiet")
        assert code == 0, err
    marker = json.loads((empty / ".forgetless.json").read_text(encoding="utf-8"))
    assert marker == {"written_by": "forgetless", "kind": "run"}


# Diagnoses write files: never over a run's results, never as a folder.

FILE_COMMANDS: dict[str, Callable[[Path], list[str]]] = {
    "geometry": lambda run: ["diagnose", "geometry", str(run)],
    "attribution": lambda run: ["diagnose", "attribution", str(run)],
    "circuits": lambda run: [
        "diagnose",
        "circuits",
        str(run / "checkpoints" / "task-01-reverse"),
        "--behaviour",
        "reverse",
    ],
    "drift": lambda run: ["diagnose", "drift", str(run / "checkpoints" / "task-01-reverse")],
}


@pytest.mark.parametrize("command", sorted(FILE_COMMANDS))
@pytest.mark.parametrize("target", ["results.json", "config.yaml", "."])
def test_diagnoses_never_replace_a_runs_files(
    command: str,
    target: str,
    finished: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = shutil.copytree(finished / "run", tmp_path / "run")
    before = snapshot(run)
    out = run / target
    code, err = cli(capsys, *FILE_COMMANDS[command](run), "--out", str(out))
    assert code == 2, err
    expected = "is a folder; give a file path" if target == "." else "is not a"
    assert expected in one_line(err)
    assert snapshot(run) == before


def test_checkpoints_that_share_only_the_root_need_an_out(tmp_path: Path) -> None:
    """circuits' and drift's default output goes beside the checkpoints, in the folder they
    share; models from unrelated places share only /, where nothing is written by default."""
    from forgetless.cli.diagnose import beside_checkpoints
    from forgetless.errors import ConfigError

    assert beside_checkpoints([tmp_path / "a", tmp_path / "b"], "drift.json") == (
        tmp_path.resolve() / "drift.json"
    )
    apart = [Path("/forgetless-test-x/model"), Path("/forgetless-test-y/model")]
    with pytest.raises(ConfigError, match="--out: the checkpoints share no folder but /; name"):
        beside_checkpoints(apart, "circuits.json")


def test_geometry_replaces_its_own_output_only(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = shutil.copytree(finished / "run", tmp_path / "run")
    out = tmp_path / "g.json"
    for _ in range(2):
        code, err = cli(capsys, "diagnose", "geometry", str(run), "--out", str(out))
        assert code == 0, err
    assert json.loads(out.read_text())["kind"] == "geometry"
    report = run / "report.md"
    report.write_text("mine", encoding="utf-8")
    code, err = cli(capsys, "diagnose", "geometry", str(run), "--out", str(run / "report.json"))
    assert code == 0, err  # a new file beside the user's: nothing is replaced
    (tmp_path / "h.png").write_text("my picture", encoding="utf-8")
    code, err = cli(capsys, "diagnose", "geometry", str(run), "--out", str(tmp_path / "h.json"))
    assert code == 2 and "h.png: exists and would be replaced" in one_line(err)
    assert (tmp_path / "h.png").read_text() == "my picture"


# Merges: into a model folder of the user's, and interrupted at any point.


def test_merge_into_a_model_folder_that_is_not_an_input_is_refused(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    theirs = shutil.copytree(tiny_model_dir, tmp_path / "their-model")
    before = snapshot(theirs)
    code, err = cli(
        capsys, "merge", str(merge_yaml(tmp_path, tiny_model_dir)), "--out", str(theirs)
    )
    assert code == 2 and "not written by forgetless" in one_line(err)
    assert snapshot(theirs) == before


def test_a_merge_replaces_an_earlier_merge_whole(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = merge_yaml(tmp_path, tiny_model_dir)
    out = tmp_path / "merged"
    assert cli(capsys, "merge", str(config), "--out", str(out))[0] == 0
    (out / "export.json").write_text("{}", encoding="utf-8")  # a stale file from elsewhere
    assert cli(capsys, "merge", str(config), "--out", str(out))[0] == 0
    assert not (out / "export.json").exists()
    assert (out / "merge.json").is_file()


class Interrupt:
    """Raises KeyboardInterrupt the ``n``-th time it is called (1-based)."""

    def __init__(self, n: int, then: Callable[..., Any] | None = None) -> None:
        self.n, self.calls, self.then = n, 0, then

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return self.then(*args, **kwargs) if self.then else None


def _plant(point: str, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None] | None:
    """Plant an interrupt at ``point``; a per-tensor point returns the progress callback."""
    from forgetless.merging import streaming

    kind, _, n = point.partition("#")
    if kind == "tensor":
        return Interrupt(int(n))
    if kind == "swap":
        monkeypatch.setattr(
            storage,
            "swap_point",
            lambda p: (_ for _ in ()).throw(KeyboardInterrupt()) if p == n else None,
        )
    elif kind == "copy":
        monkeypatch.setattr(streaming.shutil, "copy2", Interrupt(int(n), shutil.copy2))
    elif kind == "record":
        monkeypatch.setattr(streaming, "atomic_write_json", Interrupt(1))
    elif kind == "marker":
        from forgetless.core import ownership

        monkeypatch.setattr(ownership, "mark_folder", Interrupt(1))
    return None


INTERRUPTS = [
    "copy#1",
    "copy#2",
    "tensor#1",
    "tensor#6",
    "tensor#13",
    "tensor#26",
    "record#1",
    "marker#1",
    "swap#written",
    "swap#aside",
]
"""Ten points of a merge: copying the config and tokenizer, writing tensors (of 26), writing
``merge.json`` and the marker, and the two renames of the swap."""


@pytest.mark.parametrize("fresh", [False, True], ids=["onto-a-merge", "fresh"])
def test_an_interrupted_merge_leaves_the_old_folder_whole(
    fresh: bool,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM

    from forgetless.merging.config import load_merge_config
    from forgetless.merging.streaming import stream_merge

    first = load_merge_config(merge_yaml(tmp_path, tiny_model_dir))
    second = first.model_copy(update={"method": first.method.model_copy(update={"density": 0.5})})
    out = tmp_path / "merged"
    if not fresh:
        stream_merge(first, out)
    before = snapshot(out)
    weights = {} if fresh else load_file(out / "model.safetensors")
    for point in INTERRUPTS if not fresh else [p for p in INTERRUPTS if p != "swap#aside"]:
        with monkeypatch.context() as patch:
            progress = _plant(point, patch)
            with pytest.raises(KeyboardInterrupt):
                stream_merge(second, out, progress)
                pytest.fail(f"not interrupted at {point}")
        assert snapshot(out) == before, point
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [], point
        if not fresh:
            assert load_file(out / "model.safetensors").keys() == weights.keys()
            for name, tensor in load_file(out / "model.safetensors").items():
                assert torch.equal(tensor, weights[name]), (point, name)
            AutoModelForCausalLM.from_pretrained(str(out))
    stream_merge(second, out)
    assert snapshot(out) != before


# Resumes that would mix two experiments.


def _partial(config: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``config`` into ``out`` and stop it (an interrupt) as its second task begins."""
    from forgetless.training.task_loop import TaskLoop

    original = TaskLoop.run_task

    def stop_at_two(self: TaskLoop, index: int, results: Any) -> None:
        if index == 2:
            raise KeyboardInterrupt
        original(self, index, results)

    with monkeypatch.context() as patch:
        patch.setattr(TaskLoop, "run_task", stop_at_two)
        with pytest.raises(KeyboardInterrupt):
            Runner(load_config(config), out, Console(quiet=True), progress=False).run()


def _two_jsonl_tasks(tmp_path: Path, model: Path) -> tuple[Path, Path]:
    records = [{"prompt": f"q{i}=", "completion": f"a{i}"} for i in range(12)]
    first = write_jsonl(tmp_path / "first.jsonl", records)
    second = write_jsonl(tmp_path / "second.jsonl", records[::-1])
    tasks = [{"jsonl": {"train": str(first)}}, {"jsonl": {"train": str(second)}}]
    return write_yaml(tmp_path / "c.yaml", small(model, tasks=tasks)), first


def test_a_data_file_changed_between_a_partial_run_and_its_resume(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config, first = _two_jsonl_tasks(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    _partial(config, out, monkeypatch)
    write_jsonl(first, [{"prompt": f"x{i}=", "completion": f"y{i}"} for i in range(12)])
    before = snapshot(out)
    code, err = cli(capsys, "run", str(config), "--out", str(out), "--quiet")
    assert code == 2 and f"{first}: changed since the run" in one_line(err)
    assert snapshot(out) == before
    code, err = cli(
        capsys, "run", str(config), "--out", str(out), "--quiet", "--allow-config-change"
    )
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    changed = [e for e in results["events"] if e["type"] == "input_changed"]
    assert [(e["file"], e["after_task"]) for e in changed] == [(str(first), 1)]
    assert changed[0]["before"] != changed[0]["after"]
    assert cli(capsys, "report", str(out))[0] == 0
    assert "input_changed" in (out / "report.md").read_text()


def test_the_method_of_a_partial_run_cannot_change(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir))
    out = tmp_path / "out"
    _partial(config, out, monkeypatch)
    before = snapshot(out)
    args = ["run", str(config), "--out", str(out), "--quiet", "--allow-config-change"]
    code, err = cli(capsys, *args, "--set", "method.name=ewc")
    assert code == 2 and "cannot change method.name" in one_line(err)
    assert "the method's state belongs to its method" in err
    assert snapshot(out) == before


def test_an_allowed_config_change_is_recorded(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir))
    out = tmp_path / "out"
    _partial(config, out, monkeypatch)
    args = ["run", str(config), "--out", str(out), "--quiet", "--allow-config-change"]
    code, err = cli(capsys, *args, "--set", f"train.lr={SMALL['lr'] / 2}")
    assert code == 0, err
    events = json.loads((out / "results.json").read_text())["events"]
    assert {"type": "config_changed", "after_task": 1, "fields": ["train.lr"]} in events


def test_two_benches_of_different_methods_never_share_a_folder(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir, tasks=["reverse"]))
    out = tmp_path / "bench"
    args = ["bench", str(config), "--seeds", "1", "--quiet", "--out", str(out), "--methods"]
    code, err = cli(capsys, *args, "seq_ft")
    assert code == 0, err
    summary = (out / "bench.json").read_bytes()
    code, err = cli(capsys, *args, "ewc")
    assert code == 2 and "holds a bench of seq_ft" in one_line(err)
    assert (out / "bench.json").read_bytes() == summary
    assert not (out / "ewc").exists()
    assert cli(capsys, *args, "seq_ft")[0] == 0  # the same bench again resumes


def test_a_bench_that_only_adds_variants_extends_the_held_one(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir, tasks=["reverse"]))
    out = tmp_path / "bench"
    args = ["bench", str(config), "--quiet", "--out", str(out), "--methods"]
    assert cli(capsys, *args, "seq_ft", "--seeds", "1")[0] == 0
    held = (out / "seq_ft" / "s0" / "results.json").read_bytes()
    code, err = cli(capsys, *args, "seq_ft,ewc", "--seeds", "1")
    assert code == 0, err
    assert (out / "seq_ft" / "s0" / "results.json").read_bytes() == held  # kept, not re-run
    assert {r["variant"] for r in json.loads((out / "bench.json").read_text())["runs"]} == {
        "seq_ft",
        "ewc",
    }
    code, err = cli(capsys, *args, "seq_ft,ewc", "--seeds", "2")
    assert code == 2 and "holds a bench of seq_ft, ewc" in one_line(err)


def test_a_second_bench_on_a_busy_folder_is_refused_naming_the_holder(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out), "bench"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir, tasks=["reverse"]))
        args = ["bench", str(config), "--methods", "seq_ft", "--seeds", "1", "--quiet"]
        code, err = cli(capsys, *args, "--out", str(out))
        assert code == 1 and f"(PID {holder.pid})" in one_line(err)
    finally:
        holder.kill()
        holder.wait(timeout=30)


@pytest.mark.parametrize("inside", ["", "checkpoints/task-01-reverse"])
@pytest.mark.parametrize("command", ["circuits", "drift"])
def test_a_run_folder_given_as_a_model_points_to_export(
    command: str,
    inside: str,
    finished: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = finished / "run"
    given = run / inside if inside else run
    out = tmp_path / f"{command}.json"
    args = [str(tiny_model_dir), str(given), "--n", "2", "--out", str(out)]
    extra = ["--steps", "1"] if command == "circuits" else ["--probes", "copy"]
    code, err = cli(capsys, "diagnose", command, *args, *extra)
    assert code == 2, err
    assert f"CHECKPOINTS: {given} is a" in one_line(err)
    assert f"forgetless export {run} OUT" in err and not out.exists()
    if inside:
        assert err.endswith("--task 1")
