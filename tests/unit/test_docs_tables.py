"""Every bench table quoted in the README and docs is what its committed raw results render."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import render_tables  # noqa: E402


@pytest.mark.parametrize("doc", render_tables.DOCS, ids=lambda p: p.name)
def test_quoted_tables_match_their_data(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    assert render_tables.rewrite(text) == text, f"run python benchmarks/render_tables.py ({doc})"


def test_the_renderer_pairs_by_seed() -> None:
    def run(variant: str, seed: int, retention: float) -> dict[str, object]:
        metrics = {"retention": retention, "gain": 0.9, "average_accuracy": 0.5, "bwt": -0.5}
        return {"variant": variant, "seed": seed, "metrics": metrics}

    bench = {
        "variants": [{"name": "seq_ft"}, {"name": "kl"}],
        "runs": [run("seq_ft", s, r) for s, r in ((0, 0.2), (1, 0.6))]
        + [run("kl", s, r) for s, r in ((0, 0.4), (1, 0.8))],
    }
    table = render_tables.render(bench)
    kl = next(line for line in table.splitlines() if line.startswith("| kl "))
    assert kl.endswith("| 0.200 ± 0.000 | 0.000 ± 0.000 |")  # +0.2 in both seeds: no spread
