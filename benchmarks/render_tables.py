"""Render the bench tables quoted in the docs from the committed raw results.

A document holds a table between two markers::

    <!-- bench-table: bench-baselines.json -->
    ...
    <!-- /bench-table -->

and this script rewrites what lies between them from ``benchmarks/results/bench-baselines.json``
(mean ± half-width of the 95% t-interval over the seeds, paired differences to ``seq_ft``).
``--check`` exits 1 when a document differs from what its data renders (a test runs it).

    python benchmarks/render_tables.py [--check] [FILES...]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from forgetless.bench.stats import mean_interval

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- bench-table: (\S+) -->\n)(.*?)(<!-- /bench-table -->)", re.S)
COLUMNS = [
    ("average_accuracy", "avg acc"),
    ("bwt", "BWT"),
    ("gain", "gain"),
    ("retention", "probe retention"),
    ("kl_drift", "KL(base‖model)"),
]


def interval(values: list[float]) -> tuple[float, float, int]:
    """Mean and half-width of the 95% t-interval (0 for one value): ``bench.stats``'s."""
    found = mean_interval(values)
    assert found is not None, "interval of no values"
    return found.mean, (found.high - found.low) / 2, found.n


def _fmt(mean: float, half: float, n: int) -> str:
    text = f"{mean:.3f}".replace("-", "−")
    return text + (f" ± {half:.3f}" if n > 1 else "")


def _metric(run: dict[str, Any], key: str) -> float | None:
    value = run["metrics"].get(key)
    return float(value) if isinstance(value, int | float) else None


def render(bench: dict[str, Any]) -> str:
    """A markdown table: one row per variant, plus the retention gained over ``seq_ft`` paired
    by seed when the bench has a ``seq_ft`` row."""
    variants = [v["name"] for v in bench["variants"]]
    by_variant: dict[str, dict[int, dict[str, Any]]] = {}
    for run in bench["runs"]:
        by_variant.setdefault(run["variant"], {})[run["seed"]] = run
    base = by_variant.get("seq_ft", {})
    headers = ["variant", *(label for _, label in COLUMNS)]
    if base:
        headers += ["retention − seq_ft (paired)", "gain − seq_ft (paired)"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    joint = {r["variant"] for r in bench.get("rows", []) if r.get("joint_training")}
    for name in variants:
        runs = by_variant.get(name, {})
        cells = [name]
        for key, _ in COLUMNS:
            values = [v for r in runs.values() if (v := _metric(r, key)) is not None]
            if key == "bwt" and name in joint:
                cells.append("n/a (joint)")
                continue
            cells.append(_fmt(*interval(values)) if values else "n/a")
        if base:
            for key in ("retention", "gain"):
                diffs = [
                    a - b
                    for seed, r in runs.items()
                    if seed in base
                    and (a := _metric(r, key)) is not None
                    and (b := _metric(base[seed], key)) is not None
                ]
                cells.append(_fmt(*interval(diffs)) if diffs and name != "seq_ft" else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rewrite(text: str) -> str:
    def table(match: re.Match[str]) -> str:
        bench = json.loads((RESULTS / match.group(2)).read_text(encoding="utf-8"))
        return match.group(1) + render(bench) + match.group(4)

    return BLOCK.sub(table, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a document is stale")
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args()
    stale = []
    for path in args.files or DOCS:
        text = path.read_text(encoding="utf-8")
        new = rewrite(text)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print("stale tables: " + ", ".join(str(p) for p in stale), file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
