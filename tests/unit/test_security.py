"""Security: weights come from safetensors only (a pickle never runs); no config value runs."""

from __future__ import annotations

import ast
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import CrashAt, tiny_run_config
from rich.console import Console

from forgetless.config.loading import validate_config
from forgetless.config.schema import ModelConfig
from forgetless.errors import CheckpointError, ModelLoadError
from forgetless.models.loading import load_model
from forgetless.training.runner import Runner

SRC = Path(__file__).resolve().parents[2] / "src" / "forgetless"


class Payload:
    """Unpickling this creates ``marker``: the stand-in for arbitrary code in a weights file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def plant_pickle(folder: Path, marker: Path) -> None:
    with (folder / "pytorch_model.bin").open("wb") as handle:
        pickle.dump({"model.embed_tokens.weight": Payload(marker)}, handle)
    assert not marker.exists()


def test_a_model_folder_with_only_a_pickle_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_model_dir, tmp_path / "model")
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "payload-ran"
    plant_pickle(folder, marker)
    with pytest.raises(ModelLoadError, match=r"model\.name_or_path: cannot load model from") as err:
        load_model(str(folder), ModelConfig(name_or_path=str(folder)))
    assert "\n" not in str(err.value)
    assert not marker.exists(), "the pickle payload ran"


def test_a_checkpoint_holding_only_a_pickle_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    raw = tiny_run_config(
        tiny_model_dir,
        tasks=["reverse", "cipher"],
        probes=[],
        train={"steps": 1, "batch_size": 4, "max_length": 32},
        eval={"n_eval": 4, "n_train": 8, "kl_drift": False},
    )
    cfg = validate_config(raw)
    with pytest.raises(KeyboardInterrupt):  # stopped after task 1: a resume restores it
        stop = CrashAt(task=2, step=0)
        Runner(cfg, tmp_path / "out", Console(quiet=True), progress=False, method=stop).run()
    ckpt = tmp_path / "out/checkpoints/task-01-reverse"
    (ckpt / "model.safetensors").unlink()
    marker = tmp_path / "payload-ran"
    plant_pickle(ckpt, marker)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing \(weights are read"):
        Runner(cfg, tmp_path / "out", Console(quiet=True), progress=False).run()
    assert not marker.exists(), "the pickle payload ran"


def _calls(tree: ast.AST) -> list[str]:
    """Dotted names of every call in a module, e.g. ``torch.load``, ``eval``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts, func = [], node.func
            while isinstance(func, ast.Attribute):
                parts.append(func.attr)
                func = func.value
            if isinstance(func, ast.Name):
                parts.append(func.id)
                out.append((".".join(reversed(parts)), node))
    return [
        name
        for name, node in out
        if not (
            name.endswith("torch.load")
            and any(
                k.arg == "weights_only"
                and isinstance(k.value, ast.Constant)
                and k.value.value is True
                for k in node.keywords
            )
        )
    ]


FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "torch.load", "os.system", "os.popen"}
FORBIDDEN_MODULES = {"pickle", "dill", "cloudpickle", "marshal", "shelve", "subprocess"}


def test_source_never_unpickles_execs_or_shells_out() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name in _calls(tree):
            if name in FORBIDDEN_CALLS or name.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{path.relative_to(SRC)}: {name}(...)")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names.append(getattr(node, "module", None) or "")
                found += [
                    f"{path.relative_to(SRC)}: import {n}"
                    for n in names
                    if n.split(".")[0] in FORBIDDEN_MODULES
                ]
            if (
                isinstance(node, ast.keyword)
                and node.arg == "trust_remote_code"
                and isinstance(node.value, ast.Constant)
                and node.value.value is True
            ):
                found.append(f"{path.relative_to(SRC)}: trust_remote_code=True")
    assert not found, found


def test_trust_remote_code_is_off_unless_the_config_says_so() -> None:
    assert ModelConfig().trust_remote_code is False
