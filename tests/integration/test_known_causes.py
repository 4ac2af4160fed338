"""Failures with a known cause end in one line naming the place, with the exit code of its kind:
a full disk (1, the machine's fault), a model folder without its tokenizer and a corrupt results
or bench file (2, the input's), repeated Ctrl-C (130)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rich.console import Console
from safetensors import SafetensorError
from test_bad_inputs import SMALL, small_config, write_config
from test_hostile_inputs import cli, one_line

from forgetless.config.loading import load_config
from forgetless.training.runner import Runner

# 1. A full disk names the file being written; the re-run, with space again, resumes.

FULL_SAFETENSORS = "Error while serializing: I/O error: No space left on device (os error 28)"


def _raises(err: Exception) -> Callable[..., None]:
    def write(*args: object, **kwargs: object) -> None:
        raise err

    return write


_replace = os.replace


def _results_json_full(src: str, dst: str) -> None:
    if Path(dst).name == "results.json":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    _replace(src, dst)


DISK_FULL = {  # the write that fails, as what, and the place the error names
    "method state (safetensors)": (
        "forgetless.core.storage.save_file",
        _raises(SafetensorError(FULL_SAFETENSORS)),
        "checkpoints/task-01-reverse",
    ),
    "weights (OSError)": (
        "forgetless.models.finetuner.save_model",
        _raises(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))),
        "checkpoints/task-01-reverse",
    ),
    "step checkpoint (safetensors)": (
        "forgetless.engine.step_checkpoint.save_file",
        _raises(SafetensorError(FULL_SAFETENSORS)),
        "checkpoints/step-01-reverse",
    ),
    "results.json (OSError)": ("os.replace", _results_json_full, "results.json"),
}


@pytest.mark.parametrize("case", list(DISK_FULL))
def test_a_full_disk_names_the_file_and_the_rerun_resumes(
    case: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target, write, where = DISK_FULL[case]
    every = {"checkpoint_every": 1} if "step" in where else {}
    data = small_config(tiny_model_dir, train={**SMALL, **every})
    config = write_config(tmp_path / "c.yaml", data)
    out = tmp_path / "out"
    args = ["run", str(config), "--out", str(out), "--quiet"]
    with monkeypatch.context() as patch:
        patch.setattr(target, write)
        code, err = cli(capsys, *args)
    assert code == 1, err
    assert one_line(err).startswith(f"error: {out / where}: No space left on device"), err
    assert "re-run" in err
    code, err = cli(capsys, *args)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert results["status"] == "complete"


def test_a_full_disk_no_writer_names_is_still_one_line_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import forgetless.cli.app as app_module

    monkeypatch.setattr(app_module, "app", _raises(SafetensorError(FULL_SAFETENSORS)))
    code, err = cli(capsys, "run")
    assert code == 1, err
    assert one_line(err).startswith("error: ") and "No space left on device" in err, err
    assert "re-run" in err


# 2. A model folder without its tokenizer files is named, with the files it lacks and the fix.

TOKENIZER_KEPT = {  # the tokenizer files left in the folder, and model.trust_remote_code
    "none": ((), False),
    "only tokenizer_config.json": (("tokenizer_config.json",), False),
    # no files checked (remote code may name its own): the empty tokenizer is caught instead
    "none, trusting remote code": ((), True),
}


@pytest.mark.parametrize("kept", list(TOKENIZER_KEPT))
def test_a_model_folder_without_tokenizer_files_is_named(
    kept: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files, remote_code = TOKENIZER_KEPT[kept]
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", *files):
        shutil.copy(tiny_model_dir / name, folder / name)
    model = {"name_or_path": str(folder), "trust_remote_code": remote_code}
    config = write_config(tmp_path / "c.yaml", small_config(folder, model=model))
    code, err = cli(capsys, "run", str(config), "--out", str(tmp_path / "out"), "--quiet")
    assert code == 2, err
    assert f"{folder}" in one_line(err) and "tokenizer.json" in err, err
    assert "copy" in err, err  # the way out


# 3. A corrupt results.json or bench.json is named by `forgetless report`, exit 2.

CORRUPT_JSON = ['{"config": {', "[]", '{"tasks": 3}', '{"tasks": [], "config": []}']


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("finished")
    config = write_config(root / "c.yaml", small_config(tiny_model_dir))
    Runner(load_config(config), root / "out", Console(quiet=True), progress=False).run()
    return root / "out"


@pytest.mark.parametrize("text", CORRUPT_JSON)
def test_report_names_a_corrupt_results_file(
    text: str, finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = shutil.copytree(finished_run, tmp_path / "out")
    (out / "results.json").write_text(text, encoding="utf-8")
    code, err = cli(capsys, "report", str(out))
    assert code == 2, err
    assert one_line(err).startswith(f"error: {out / 'results.json'}: "), err


def _bench(
    run_folder: Path, run_changes: dict[str, object] | None = None, **changes: object
) -> dict[str, object]:
    """A bench.json as ``bench`` writes it, of one seq_ft run in ``run_folder``."""
    run = {
        "variant": "seq",
        "folder": str(run_folder),
        "metrics": {"average_accuracy": 0.5, "bwt": -0.1},
        "train_seconds": 1.0,
        "steps": 2,
        **(run_changes or {}),
    }
    bench = {
        "schema_version": 1,
        "seeds": 1,
        "orders": 1,
        "variants": [{"name": "seq", "method": {"name": "seq_ft"}}],
        "runs": [run],
    }
    return {**bench, **changes}


BAD_BENCH = {
    "truncated": '{"seeds": 1, "runs": [',
    "a list": "[]",
    "runs not a list": json.dumps({"seeds": 1, "orders": 1, "variants": [], "runs": 3}),
    "a variant without a method": json.dumps(_bench(Path("x"), variants=[{"name": "seq"}])),
    "an unknown method": json.dumps(
        _bench(Path("x"), variants=[{"name": "seq", "method": {"name": "nope"}}])
    ),
    "a run without metrics": json.dumps(_bench(Path("x"), runs=[{"variant": "seq"}])),
    "a metric that is text": json.dumps(_bench(Path("x"), {"metrics": {"bwt": "-0.1"}})),
}


@pytest.mark.parametrize("case", list(BAD_BENCH))
def test_report_names_a_corrupt_bench_file(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bench.json").write_text(BAD_BENCH[case], encoding="utf-8")
    code, err = cli(capsys, "report", str(tmp_path))
    assert code == 2, err
    assert one_line(err).startswith(f"error: {tmp_path / 'bench.json'}: "), err


def test_report_names_a_corrupt_results_file_of_a_bench_run(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = shutil.copytree(finished_run, tmp_path / "seq" / "s0")
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "bench.json").write_text(json.dumps(_bench(run)), encoding="utf-8")
    assert cli(capsys, "report", str(bench))[0] == 0  # the bench as it was written: reported
    (run / "results.json").write_text("[]", encoding="utf-8")
    code, err = cli(capsys, "report", str(bench))
    assert code == 2, err
    assert one_line(err).startswith(f"error: {run / 'results.json'}: "), err


# 4. Ctrl-C again while the first one's clean-up or the exit runs: still the one last line
# "interrupted" and exit 130, never a traceback (nor death by the signal, exit -2).

AFTER_FIRST_CTRL_C = {  # what comes before each further Ctrl-C: a pause, or a line on stderr
    "during the clean-up": [0.05],
    "during the exit": ["interrupted"],
    "three times": [0.05, 0.05],
}


def _read_until(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stderr is not None
    seen = ""
    while not seen.endswith(f"{line}\n"):
        more = proc.stderr.readline()
        if not more:  # the process has ended
            break
        seen += more
    return seen


def _start_run(config: Path, out: Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "forgetless", "run", str(config), "--out", str(out)]
    return subprocess.Popen(  # Ctrl-C as a shell delivers it, whatever the test process set
        [*command, "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _interrupt(proc: subprocess.Popen[str], out: Path, then: list[float | str]) -> str:
    deadline = time.monotonic() + 120
    while not (out / "results.json").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)  # the base row is written: training has started
    proc.send_signal(signal.SIGINT)
    err = ""
    for step in then:
        if isinstance(step, str):
            err += _read_until(proc, step)
        else:
            time.sleep(step)
        proc.send_signal(signal.SIGINT)
    return err + proc.communicate(timeout=60)[1]


def test_repeated_ctrl_c_ends_in_one_line_and_exit_130(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = small_config(tiny_model_dir, train={**SMALL, "steps": 100_000})
    config = write_config(tmp_path / "c.yaml", data)
    outs = {case: tmp_path / f"out{i}" for i, case in enumerate(AFTER_FIRST_CTRL_C)}
    procs = {case: _start_run(config, out) for case, out in outs.items()}  # side by side
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            ended = {
                case: pool.submit(_interrupt, proc, outs[case], AFTER_FIRST_CTRL_C[case])
                for case, proc in procs.items()
            }
        errs = {case: future.result() for case, future in ended.items()}
    finally:
        for proc in procs.values():
            proc.kill()  # never leave a 100,000-step run behind a failed assertion
    for case, err in errs.items():
        code = procs[case].returncode
        assert code == 130, (case, code, err)
        assert "Traceback" not in err and "Exception ignored" not in err, (case, err)
        assert err.strip().splitlines()[-1] == "interrupted", (case, err)
