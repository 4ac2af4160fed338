"""The run report's "Where the time went" table: per row, training, evaluation and its parts."""

from __future__ import annotations

from forgetless.report.render import _time_section


def results(parts: object) -> dict[str, object]:
    return {
        "tasks": ["json", "robot"],
        "per_task": [{"train_seconds": 130.25}, {"train_seconds": 128.0}],
        "eval_seconds": [0.04, 31.8, 91.0],
        "eval_parts": parts,
    }


def test_each_row_names_its_training_evaluation_and_largest_parts() -> None:
    parts = [{"cache": 0.04}, {"json": 2.4, "loglik": 7.9, "gk-mc": 1.2, "prose": 2.8}, {}]
    section = _time_section(results(parts))
    assert section.rows == [
        ["base", "–", "0.0", "cache 0.0"],
        ["json", "130.2", "31.8", "loglik 7.9, prose 2.8, json 2.4"],
        ["robot", "128.0", "91.0", "n/a"],
    ]


def test_parts_missing_or_hand_edited_read_as_not_available() -> None:
    for parts in (None, [], ["x", {"a": "slow"}, 3]):
        rows = _time_section(results(parts)).rows
        assert [row[3] for row in rows] == ["n/a"] * 3
        assert [row[2] for row in rows] == ["0.0", "31.8", "91.0"]
