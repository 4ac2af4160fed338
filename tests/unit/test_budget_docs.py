"""docs/budget.md's table of knobs names every method that declares one, with its field,
direction and bounds, and no method without one."""

from __future__ import annotations

import re
from pathlib import Path

from forgetless.contract import registered_methods

DOC = Path(__file__).parents[2] / "docs" / "budget.md"


def _rows() -> dict[str, str]:
    text = DOC.read_text(encoding="utf-8").split("## The knobs", 1)[1].split("\n\n", 3)[2]
    rows: dict[str, str] = {}
    for line in text.splitlines()[2:]:
        names = line.split("|")[1]
        for name in re.findall(r"`([a-z_]+)`", names):
            rows[name] = line
    return rows


def test_the_knob_table_is_the_knobs_the_methods_declare() -> None:
    knobs = {n: c.knob for n, c in registered_methods().items() if c.knob is not None}
    rows = _rows()
    assert set(rows) == set(knobs)
    for name, knob in knobs.items():
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        assert f"`{knob.field}`" in cells[1], (name, cells[1])
        assert cells[2] == knob.keeps_more, (name, cells[2])
        low, high = (float(v) for v in cells[3].split()[0].split("–"))
        assert (low, high) == (knob.low, knob.high), (name, cells[3])
