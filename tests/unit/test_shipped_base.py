"""The tiny base ships in the package: its hash is the one the docs record, the default config
finds it, and nothing pretrains by default."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

import forgetless.training.pretrain as pretrain
from forgetless.config.loading import load_config
from forgetless.training.pretrain import SHIPPED_BASE, base_fingerprint, ensure_base_model

DOC = Path(__file__).resolve().parents[2] / "docs" / "tiny-suite.md"


def _documented(key: str) -> str:
    match = re.search(rf"^{re.escape(key)}: `([^`]+)`", DOC.read_text(encoding="utf-8"), re.M)
    assert match, f"docs/tiny-suite.md has no line '{key}: `...`'"
    return match.group(1)


def test_the_shipped_weights_are_the_documented_ones() -> None:
    digest = hashlib.sha256((SHIPPED_BASE / "model.safetensors").read_bytes()).hexdigest()
    assert digest == _documented("model.safetensors sha256")


def test_the_documented_probe_scores_are_the_shipped_ones() -> None:
    meta = json.loads((SHIPPED_BASE / "pretrain.json").read_text(encoding="utf-8"))
    documented = json.loads(_documented("probe scores"))
    assert documented == {k: meta["accuracy"][k] for k in documented}
    assert all(meta["accuracy"][k] >= 0.9 for k in ("copy", "upper", "facts", "add"))


def test_the_default_config_uses_the_shipped_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(None, preset="tiny")
    meta = json.loads((SHIPPED_BASE / "pretrain.json").read_text(encoding="utf-8"))
    assert meta["fingerprint"] == base_fingerprint(cfg.model) == _documented("fingerprint")
    # An empty cache: the shipped folder comes back, nothing is pretrained or written.
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path))
    assert ensure_base_model(cfg.model, Console(quiet=True), progress=False) == SHIPPED_BASE
    assert not any(tmp_path.iterdir())


def test_runs_needing_an_unshipped_base_at_once_pretrain_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(None, preset="tiny", overrides=["model.pretrain.seed=7"]).model
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path))
    trained: list[Path] = []

    def slow_pretrain(cfg: object, folder: Path, *args: object) -> None:
        trained.append(folder)
        time.sleep(0.3)  # long enough for the other run to look at the cache meanwhile
        folder.mkdir(parents=True)
        (folder / "pretrain.json").write_text("{}", encoding="utf-8")

    monkeypatch.setattr(pretrain, "pretrain_base", slow_pretrain)
    got: list[Path] = []
    runs = [
        threading.Thread(target=lambda: got.append(ensure_base_model(cfg, Console(quiet=True))))
        for _ in range(2)
    ]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert len(trained) == 1 and got == [trained[0]] * 2
