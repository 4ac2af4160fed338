"""A bench record names the load beside its run, so cost ratios compare only undisturbed runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from forgetless.bench import campaign
from forgetless.config.loading import validate_config
from forgetless.testing import tiny_run_config
from forgetless.training.startup import runtime


@pytest.mark.parametrize(
    ("start", "end", "shared"),
    [(0.1, 1.2, False), (1.4, 1.3, True), (0.2, 3.5, True), (None, 1.0, None), (None, 9.0, True)],
)
def test_shared_cores_from_the_load_at_both_ends(
    monkeypatch: pytest.MonkeyPatch, start: float | None, end: float, shared: bool | None
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(campaign, "load_average", lambda: end)
    found = campaign.contention(start)
    assert found == {"load_start": start, "load_end": end, "shared_cores": shared}


def test_every_record_carries_its_contention() -> None:
    record = campaign.provenance(0.0)
    assert set(record["contention"]) == {"load_start", "load_end", "shared_cores"}
    assert record["machine"]["threads"] == torch.get_num_threads()


def test_a_record_of_a_run_in_another_process_carries_that_runs_load_and_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker (``bench --jobs``) or cluster job records its own start in ``runtime``; the
    parent that keeps the run reads it there, not its own load and threads."""
    monkeypatch.setattr(campaign, "load_average", lambda: 2.5)
    cfg = validate_config(tiny_run_config(tmp_path))
    results = {"runtime": {"threads": 3, "load_at_start": 1.25}}
    path = tmp_path / "record.json"
    campaign.save_record(path, cfg, {}, results)
    record = json.loads(path.read_text())
    assert record["machine"]["threads"] == 3
    assert record["contention"] == {"load_start": 1.25, "load_end": 2.5, "shared_cores": True}


def test_a_runs_runtime_names_its_threads_and_the_load_at_its_start(tmp_path: Path) -> None:
    cfg = validate_config(tiny_run_config(tmp_path))
    found = runtime(cfg, nn.Linear(2, 2), torch.device("cpu"))
    assert found["threads"] == torch.get_num_threads()
    assert found["load_at_start"] is None or found["load_at_start"] >= 0


def _repository(root: Path, head: str) -> Path:
    git = root / "repo" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("a" * 40 + "\n")
    (git / "packed-refs").write_text(f"{'c' * 40} refs/heads/packed\n")
    own = git / "worktrees" / "campaign"
    own.mkdir(parents=True)
    (own / "HEAD").write_text(head)
    (own / "commondir").write_text("../..\n")
    tree = root / "campaign"
    tree.mkdir()
    (tree / ".git").write_text(f"gitdir: {own}\n")
    return tree


@pytest.mark.parametrize(
    ("head", "commit"),
    [
        ("b" * 40 + "\n", "b" * 40),  # detached, as a campaign's worktree is
        ("ref: refs/heads/main\n", "a" * 40),  # a branch: its ref in the common folder
        ("ref: refs/heads/packed\n", "c" * 40),
    ],
)
def test_a_record_made_in_a_linked_worktree_names_its_commit(
    tmp_path: Path, head: str, commit: str
) -> None:
    tree = _repository(tmp_path, head)
    assert campaign.git_commit(tree / "studies") == commit
    assert campaign.git_commit(tmp_path / "repo") == "a" * 40
    assert campaign.git_commit(tmp_path) is None
