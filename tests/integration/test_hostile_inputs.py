"""The holes found by hostile inputs, each closed: nothing outside --out is touched, no failure
ends in exit 0, and every failure is one line (docs/reliability.md, "Hostile inputs")."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file, save_file
from test_bad_inputs import SMALL, snapshot
from test_bad_inputs import small_config as small
from test_bad_inputs import write_config as write_yaml

from forgetless.cli.app import run_cli
from forgetless.config.loading import load_config
from forgetless.core.rundir import RunDir
from forgetless.core.storage import (
    atomic_write_text,
    cache_fill_lock,
    lock_folder,
    remove_stale_temps,
    temp_file_name,
)
from forgetless.engine.loop import NonFiniteError, check_finite_weights
from forgetless.errors import ConfigError, EnvironmentFault
from forgetless.training.runner import Runner


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = run_cli(list(args))
    return code, capsys.readouterr().err.strip()


def one_line(err: str) -> str:
    assert err and "\n" not in err, f"not one line: {err!r}"
    assert "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A finished 1-task run (reverse, cipher planned: stopped after the first) to copy."""
    root = tmp_path_factory.mktemp("finished")
    config = write_yaml(root / "run.yaml", small(tiny_model_dir))
    Runner(load_config(config), root / "out", Console(quiet=True), progress=False).run()
    return root


def copy_run(finished: Path, tmp_path: Path) -> tuple[Path, Path]:
    import shutil

    out = shutil.copytree(finished / "out", tmp_path / "out")
    return out, finished / "run.yaml"


# 1. A task name cannot leave the output folder.


def test_task_name_that_escapes_out_is_refused_and_the_victim_kept(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine", encoding="utf-8")
    tasks = [{"builtin": "reverse", "name": "../../../../victim"}]
    config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir, tasks=tasks))
    code, err = cli(capsys, "run", str(config), "--out", str(tmp_path / "a" / "b"), "--quiet")
    assert code == 2
    assert "tasks.0" in one_line(err) and "not usable as a folder name" in err
    assert snapshot(victim) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("name", ["..", ".hidden", "a/b", "a\\b", "rev[/x]", "x" * 101])
def test_unsafe_task_names_fail_validation(tiny_model_dir: Path, name: str) -> None:
    data = small(tiny_model_dir, tasks=[{"builtin": "reverse", "name": name}])
    from forgetless.config.loading import validate_config

    with pytest.raises(ConfigError, match=r"tasks\.0"):
        validate_config(data)


def test_checkpoint_paths_are_proved_inside_out(tmp_path: Path) -> None:
    assert RunDir(tmp_path).task_checkpoint(1, "reverse").parent == tmp_path / "checkpoints"
    with pytest.raises(ConfigError, match="outside the output folder"):
        RunDir(tmp_path).task_checkpoint(1, "x/../../../../elsewhere")


# 2-4. Merges refuse their own inputs as output, other models, and wrong shapes.


@pytest.fixture(scope="module")
def merge_inputs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("merge-inputs")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    model.save_pretrained(str(root / "task"))
    return root


def merge_config(folder: Path, base: Path, tasks: list[Path]) -> Path:
    data = {
        "base_model": str(base),
        "tasks": [{"path": str(t)} for t in tasks],
        "method": {"name": "task_arithmetic"},
    }
    return write_yaml(folder / "merge.yaml", data)


def test_merge_refuses_an_out_that_is_one_of_its_inputs(
    tmp_path: Path,
    tiny_model_dir: Path,
    merge_inputs: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    task = merge_inputs / "task"
    before = snapshot(task)
    config = merge_config(tmp_path, tiny_model_dir, [task])
    code, err = cli(capsys, "merge", str(config), "--out", str(task))
    assert code == 2 and "is the input tasks.0" in one_line(err)
    assert snapshot(task) == before
    code, err = cli(capsys, "merge", str(config), "--out", str(tiny_model_dir))
    assert code == 2 and "base_model" in one_line(err)


def _foreign_checkpoint(folder: Path) -> Path:
    folder.mkdir()
    save_file({"other.weight": torch.ones(3, 3)}, str(folder / "model.safetensors"))
    return folder


def _foreign_adapter(folder: Path) -> Path:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    tensors = {
        "base_model.model.nowhere.q_proj.lora_A.weight": torch.ones(2, 32),
        "base_model.model.nowhere.q_proj.lora_B.weight": torch.ones(32, 2),
    }
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def _wrong_shape(folder: Path, base: Path) -> Path:
    folder.mkdir()
    tensors = load_file(str(base / "model.safetensors"))
    name = next(k for k, v in tensors.items() if v.ndim == 2 and "layers" in k)
    tensors[name] = tensors[name][:1].clone()  # [1, d] against [d', d]: would broadcast
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("foreign checkpoint", "is not in the base model: the task is from another model"),
        ("foreign adapter", "is not in the base model: the task is from another model"),
        ("wrong shape", "the task is from another model"),
    ],
)
def test_merge_refuses_another_models_task_before_writing(
    tmp_path: Path,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    kind: str,
    expected: str,
) -> None:
    source = tmp_path / "task"
    if kind == "foreign checkpoint":
        _foreign_checkpoint(source)
    elif kind == "foreign adapter":
        _foreign_adapter(source)
    else:
        _wrong_shape(source, tiny_model_dir)
    config = merge_config(tmp_path, tiny_model_dir, [source])
    code, err = cli(capsys, "merge", str(config), "--out", str(tmp_path / "merged"))
    assert code == 2 and expected in one_line(err)
    assert not (tmp_path / "merged").exists()


def test_merge_reports_how_many_tensors_each_task_changed(
    tmp_path: Path,
    tiny_model_dir: Path,
    merge_inputs: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = merge_config(tmp_path, tiny_model_dir, [merge_inputs / "task", tiny_model_dir])
    code, _ = cli(capsys, "merge", str(config), "--out", str(tmp_path / "merged"))
    assert code == 0
    record = json.loads((tmp_path / "merged" / "merge.json").read_text())
    n = len(load_file(str(tmp_path / "merged" / "model.safetensors")))
    assert record["changed_tensors"][1] == 0  # the base merged into itself changes nothing
    assert 0 < record["changed_tensors"][0] <= n


def test_task_vector_refuses_to_broadcast() -> None:
    from forgetless.merging.task_arithmetic import task_vector

    with pytest.raises(ValueError, match="shapes"):
        task_vector(torch.zeros(4, 4), torch.zeros(1, 4))


# 5. Ctrl-C is one line and exit 130.


def test_interrupt_exits_130_with_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = small(tiny_model_dir, train={**SMALL, "steps": 100_000})
    config = write_yaml(tmp_path / "c.yaml", data)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "forgetless", "run", str(config), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(  # Ctrl-C as a shell delivers it, whatever the test process set
        [*command, "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 300  # generous: a loaded machine starts slowly
        while not (out / "results.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)  # the base row is written: training has started
        assert (out / "results.json").is_file(), "the run never wrote its base row"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()  # never leave a 100,000-step run behind a failed assertion
    assert proc.returncode == 130
    assert one_line(err.strip()) == "interrupted"


def test_typer_return_code_is_not_dropped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import forgetless.cli.app as app_module

    def interrupted(**kwargs: Any) -> int:
        return 130

    monkeypatch.setattr(app_module, "app", interrupted)
    code, err = cli(capsys, "run")
    assert code == 130 and err == "interrupted"


# 6. Non-finite numbers are refused, and non-finite weights stop the run.


@pytest.mark.parametrize(
    "override",
    ["train.lr=.inf", "train.epochs=.inf", "train.lr=.nan", "seed=1180591620717411303424"],
)
def test_non_finite_and_huge_numbers_fail_validation(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], override: str
) -> None:
    config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir))
    code, err = cli(capsys, "validate", str(config), "--set", override)
    assert code == 2 and override.split("=")[0] in one_line(err)


def test_non_finite_weights_are_caught() -> None:
    good, bad = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.tensor([1.0, 0.0]))
    check_finite_weights([good], "t", 0)
    with torch.no_grad():
        bad[1] = float("inf")
    with pytest.raises(NonFiniteError, match="weights are no longer finite"):
        check_finite_weights([good, bad], "t", 4)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_an_update_that_breaks_the_weights_never_ends_complete(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], policy: str
) -> None:
    # AdamW's decoupled decay multiplies each weight by 1 − lr·wd = −1e40: inf in float32.
    train = {**SMALL, "steps": 1, "lr": 1e30, "weight_decay": 1e10, "on_nonfinite": policy}
    config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir, train=train))
    out = tmp_path / "out"
    code, err = cli(capsys, "run", str(config), "--out", str(out), "--quiet")
    assert code == 2 and "weights are no longer finite" in one_line(err)
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "running"
    assert results["events"][-1]["term"] == "weights"
    assert not (out / "checkpoints" / "task-01-reverse").exists()


# 7-8. A config change that cannot be honoured is refused before anything is written.


def test_new_task_list_under_allow_config_change_is_refused_untouched(
    tmp_path: Path, finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, config = copy_run(finished, tmp_path)
    before = snapshot(out)
    code, err = cli(
        capsys,
        "run",
        str(config),
        "--out",
        str(out),
        "--quiet",
        "--allow-config-change",
        "--set",
        "tasks=[reverse, sort, count]",
    )
    assert code == 2 and "cannot change them to reverse, sort, count" in one_line(err)
    assert snapshot(out) == before


@pytest.mark.parametrize("override", ["finetune.mode=lora", "model.tiny.hidden_size=64"])
def test_changes_the_checkpoints_depend_on_are_refused(
    tmp_path: Path, finished: Path, capsys: pytest.CaptureFixture[str], override: str
) -> None:
    out, config = copy_run(finished, tmp_path)
    before = snapshot(out)
    args = ["--quiet", "--allow-config-change", "--set", override]
    code, err = cli(capsys, "run", str(config), "--out", str(out), *args)
    assert code == 2 and override.split("=")[0] in one_line(err)
    assert snapshot(out) == before


def test_guard_reads_results_config_when_config_yaml_is_gone(
    tmp_path: Path, finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, config = copy_run(finished, tmp_path)
    (out / "config.yaml").unlink()
    before = snapshot(out)
    code, err = cli(
        capsys, "run", str(config), "--out", str(out), "--quiet", "--set", "train.lr=0.005"
    )
    assert code == 2 and "results.json: stored config differs at train.lr" in one_line(err)
    assert snapshot(out) == before


def test_a_failed_runs_config_does_not_block_the_corrected_one(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = small(tiny_model_dir, tasks=[{"jsonl": {"train": str(tmp_path / "none.jsonl")}}])
    out = tmp_path / "out"
    code, _ = cli(capsys, "run", str(write_yaml(tmp_path / "bad.yaml", bad)), "--out", str(out))
    assert code == 2
    good = write_yaml(tmp_path / "good.yaml", small(tiny_model_dir, tasks=["reverse"]))
    code, err = cli(capsys, "run", str(good), "--out", str(out), "--quiet")
    assert code == 0, err


# 9. Booleans are not numbers.


@pytest.mark.parametrize("override", ["train.steps=yes", "train.batch_size=on", "train.lr=true"])
def test_booleans_are_refused_as_numbers(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], override: str
) -> None:
    config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir))
    code, err = cli(capsys, "validate", str(config), "--set", override)
    assert code == 2 and "expected a number, got the boolean" in one_line(err)


# 10. Clean-up touches only the program's own temporary names.


def test_resume_keeps_user_files_named_like_temporaries(
    tmp_path: Path, finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, config = copy_run(finished, tmp_path)
    mine = [out / ".notes.tmp-1", out / ".draft.tmp-abc", out / "checkpoints" / ".tmp-keep"]
    for path in mine:
        path.write_text("mine", encoding="utf-8")
    stale = temp_file_name(out / "results.json")
    stale.write_text("half", encoding="utf-8")
    code, err = cli(capsys, "run", str(config), "--out", str(out), "--quiet")
    assert code == 0, err
    assert all(p.read_text() == "mine" for p in mine)
    assert not stale.exists()


def test_a_failed_atomic_write_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "x.json", "data")
    assert list(tmp_path.iterdir()) == []


def test_a_cache_that_cannot_be_written_still_locks_a_fill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "a-file" / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with cache_fill_lock(tmp_path / "run" / "sae"):
        held = list((tmp_path / "tmp").glob("forgetless-locks-*/*.lock"))
    assert len(held) == 1 and not (tmp_path / "run").exists()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a-file" / "tmp"))
    with pytest.raises(EnvironmentFault, match=r"^\$FORGETLESS_CACHE \(.*a-file/cache\): cannot"):
        lock_folder()


def test_a_read_only_locks_folder_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    read_only = tmp_path / "cache" / "locks"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: Path(p) != read_only and real_access(p, m))
    assert lock_folder().parent == tmp_path / "tmp"


# One error boundary: every expected failure is one line with its exit code.


def test_foreign_and_truncated_files_in_out_are_one_line(
    tmp_path: Path, finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for index, (name, text) in enumerate(
        [
            ("results.json", '{"tasks": 3}'),
            ("results.json", '{"config": {'),
            ("config.yaml", "train: {lr: [\n"),
            ("config.yaml", "- a list\n"),
        ]
    ):
        out, config = copy_run(finished, tmp_path / str(index))
        (out / name).write_text(text, encoding="utf-8")
        before = snapshot(out)
        code, err = cli(capsys, "run", str(config), "--out", str(out), "--quiet")
        assert code == 2 and name in one_line(err), (name, text, err)
        assert snapshot(out) == before


def test_damaged_step_state_is_one_line(tmp_path: Path) -> None:
    from forgetless.contract.plan import TrainPlan
    from forgetless.engine.step_checkpoint import StepCheckpointer, plan_fingerprint
    from forgetless.errors import CheckpointError
    from forgetless.methods.seq_ft import SeqFT, SeqFTConfig

    plan = TrainPlan(steps=4, batch_size=4, lr=1e-3, seed=1)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    folder = tmp_path / "step-01-x"
    folder.mkdir()
    weights = {f"weights/{n}": p.detach().clone() for n, p in model.named_parameters()}
    save_file(weights, str(folder / "step_state.safetensors"))
    # the right plan, and nothing else: a file of another version, or hand-edited
    (folder / "step_state.json").write_text(json.dumps({"plan": plan_fingerprint(plan)}))
    saver = StepCheckpointer(folder, 1, SeqFT(SeqFTConfig(name="seq_ft")), plan_fingerprint(plan))
    with pytest.raises(CheckpointError, match="damaged step checkpoint") as info:
        saver.resume(model, optimizer, scheduler)
    assert "step-01-x" in one_line(str(info.value))


def test_usage_errors_are_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = cli(capsys, "run", "--bogus")
    assert code == 2 and "--bogus" in one_line(err)
    code, err = cli(capsys, "run", "--set")
    assert code == 2 and "--set" in one_line(err)


def test_out_that_is_a_file_is_one_line(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir))
    (tmp_path / "file").write_text("x")
    code, err = cli(capsys, "run", str(config), "--out", str(tmp_path / "file"), "--quiet")
    assert code == 2 and "is a file" in one_line(err)


def test_disk_full_is_one_line_exit_1(
    tmp_path: Path,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from forgetless.training import run_writer

    def full(path: Path, text: str) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(run_writer, "atomic_write_text", full)
    config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir))
    code, err = cli(capsys, "run", str(config), "--out", str(tmp_path / "out"), "--quiet")
    assert code == 1 and "No space left on device" in one_line(err)
    assert "config.yaml" in err


def test_unexpected_errors_are_one_line_unless_debug(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import forgetless.cli.app as app_module

    def broken(**kwargs: Any) -> int:
        raise RuntimeError("something odd")

    monkeypatch.setattr(app_module, "app", broken)
    code, err = cli(capsys, "run")
    assert code == 1 and "something odd" in one_line(err) and "--debug" in err
    with pytest.raises(RuntimeError):
        run_cli(["run", "--debug"])


def test_markup_in_a_probe_or_task_name_cannot_break_the_report() -> None:
    from forgetless.config.schema import TASK_NAME

    assert not TASK_NAME.fullmatch("rev[/x]")


def test_non_ascii_text_on_the_char_tokenizer_is_reported(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conftest import write_jsonl

    records = [{"prompt": f"q{i}=", "completion": f"ä{i}"} for i in range(12)]
    jsonl = write_jsonl(tmp_path / "umlaut.jsonl", records)
    data = small(tiny_model_dir, tasks=[{"jsonl": {"train": str(jsonl)}}])
    config = write_yaml(tmp_path / "c.yaml", {**data, "train": {**SMALL, "steps": 1}})
    out = tmp_path / "out"
    code, err = cli(capsys, "run", str(config), "--out", str(out), "--quiet")
    assert code == 0, err
    events = json.loads((out / "results.json").read_text())["events"]
    assert any(e["type"] == "unknown_tokens" and e["task"] == "umlaut" for e in events)


# A lock on the output folder.


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from forgetless.training.outdir import OutDirLock
    with OutDirLock(Path(sys.argv[1]), *sys.argv[2:]):
        print("locked", flush=True)
        time.sleep(600)
    """
)


def test_second_writer_is_refused_and_a_killed_holders_lock_taken_over(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        config = write_yaml(tmp_path / "c.yaml", small(tiny_model_dir, tasks=["reverse"]))
        code, err = cli(capsys, "run", str(config), "--out", str(out), "--quiet")
        assert code == 1 and "another forgetless process is writing" in one_line(err)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        code, err = cli(capsys, "run", str(config), "--out", str(out), "--quiet")
        assert code == 0, err
    finally:
        holder.kill()
        holder.wait(timeout=30)


# atomic_dir: a kill at any point of the swap leaves one whole copy.


KILLED_SWAP = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from forgetless.core import storage as checkpoint

    final, point = Path(sys.argv[1]), sys.argv[2]

    def planted(reached):
        if point == "removing" and reached == "swapped":
            old = final.with_name(".forgetless-tmp-old-" + final.name)
            (old / "a.txt").unlink()  # part of the old copy is already gone
            os.kill(os.getpid(), signal.SIGKILL)
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.swap_point = planted
    with checkpoint.atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("new")
        if point == "inside":
            os.kill(os.getpid(), signal.SIGKILL)
        (tmp / "b.txt").write_text("new")
    """
)


@pytest.mark.parametrize(
    "point, survivor",
    [
        ("inside", "old"),
        ("written", "old"),
        ("aside", "old"),
        ("swapped", "new"),
        ("removing", "new"),
    ],
)
def test_atomic_dir_recovers_from_a_kill_at_every_point(
    tmp_path: Path, point: str, survivor: str
) -> None:
    out = tmp_path / "run"
    final = out / "checkpoints" / "task-01-x"
    final.mkdir(parents=True)
    for name in ("a.txt", "b.txt"):
        (final / name).write_text("old")
    done = subprocess.run([sys.executable, "-c", KILLED_SWAP, str(final), point], check=False)
    assert done.returncode == -signal.SIGKILL
    remove_stale_temps(out)  # what the next start does
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["task-01-x"]
    assert {p.read_text() for p in final.iterdir()} == {survivor}
    assert len(list(final.iterdir())) == 2
