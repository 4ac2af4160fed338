"""Self-SFT / Iter-SFT: targets are the model's own accepted answers, and training on them keeps
the base's behaviour where SFT on the gold answers overwrites it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import write_jsonl
from rich.console import Console

from forgetless.config.loading import validate_config
from forgetless.methods.self_sft import round_steps, self_targets
from forgetless.tasks.base import Example
from forgetless.training.pretrain import SHIPPED_BASE
from forgetless.training.runner import Runner


def test_accepted_answers_replace_the_gold_ones_and_the_rest_keep_it() -> None:
    chat = Example(
        "q",
        "gold",
        messages=({"role": "user", "content": "q"}, {"role": "assistant", "content": "gold"}),
    )
    plain = Example("p", "gold")
    out = self_targets([chat, plain, plain], ["mine", "ours", "wrong"], [True, True, False])
    assert out[0].completion == "mine" and out[0].messages is not None
    assert out[0].messages[-1] == {"role": "assistant", "content": "mine"}
    assert out[0].messages[0] == chat.messages[0]  # type: ignore[index]
    assert out[1].completion == "ours" and out[2] is plain


@pytest.mark.parametrize(("total", "rounds"), [(10, 1), (10, 3), (2, 3), (200, 5)])
def test_rounds_share_the_task_steps(total: int, rounds: int) -> None:
    steps = round_steps(total, rounds)
    assert len(steps) == rounds and sum(steps) == total and max(steps) - min(steps) <= 1


def _prefix_task(tmp_path: Path) -> dict[str, Any]:
    """A task the shipped base already does in its own words: the reference is the first two
    letters of the word and the scorer accepts any answer starting with them, so the base's full
    copy is right; SFT on the gold answers teaches it to stop after two letters instead."""
    words = ["".join(chr(97 + (7 * i + 3 * j * j) % 26) for j in range(5)) for i in range(160)]
    rows = [{"prompt": f"copy: {w} >", "completion": w[:2]} for w in words]
    write_jsonl(tmp_path / "prefix.jsonl", rows)
    return {
        "name": "prefix",
        "jsonl": {"train": str(tmp_path / "prefix.jsonl")},
        "scorer": "startswith",
    }


def _run(tmp_path: Path, method: dict[str, Any], name: str) -> dict[str, Any]:
    raw = {
        "seed": 0,
        "model": {"name_or_path": str(SHIPPED_BASE)},
        "train": {"steps": 40, "batch_size": 16, "lr": 1e-3, "max_length": 32},
        "eval": {"n_eval": 32, "batch_size": 32, "kl_examples": 8},
        "tasks": [_prefix_task(tmp_path)],
        "probes": ["copy"],
        "method": method,
    }
    runner = Runner(validate_config(raw), tmp_path / name, Console(quiet=True), progress=False)
    return runner.run().to_json()


def test_self_sft_learns_the_task_and_keeps_the_copy_skill_sft_overwrites(tmp_path: Path) -> None:
    sft = _run(tmp_path, {"name": "seq_ft"}, "sft")
    own = _run(tmp_path, {"name": "self_sft", "rounds": 2}, "self")
    task = lambda r: r["accuracy_matrix"][0][0]  # noqa: E731
    copy = lambda r: r["probe_accuracy"][-1][0]  # noqa: E731
    assert task(own) >= 0.9 and task(sft) >= 0.9
    shares = own["per_task"][0]["details"]["replaced_share"]
    assert len(shares) == 2 and min(shares) >= 0.8  # the base's full copies are its targets
    assert copy(own) >= 0.9 > 0.5 >= copy(sft)
