"""The bench table printed at the end of ``make demo`` reads in 80 columns and through a pipe."""

from __future__ import annotations

import io

from rich.console import Console

from forgetless.report.table import bench_screen_table


def _interval(mean: float, half: float, n: int) -> dict[str, float]:
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def _rows(n: int) -> list[dict[str, object]]:
    names = ["seq_ft", "replay", "ewc", "kl_sft", "attribution_gate@strength=0.5", "mtl"]
    return [
        {
            "variant": name,
            "average_accuracy": _interval(0.345, 0.123, n),
            "bwt": _interval(-0.812, 0.05, n),
            "gain": _interval(0.951, 0.011, n),
            "retention": _interval(0.412, 0.2, n),
            "time_vs_seq_ft": 1.23,
            "joint_training": name == "mtl",
        }
        for name in names
    ]


def test_the_bench_table_fits_80_columns_when_piped() -> None:
    for seeds in (1, 3):
        out = io.StringIO()
        Console(file=out, width=80, force_terminal=False).print(bench_screen_table(_rows(seeds)))
        text = out.getvalue()
        assert "…" not in text
        assert max(len(line) for line in text.splitlines()) <= 80
        assert "0.41±0.20" in text if seeds == 3 else "0.41" in text
        assert "attribution_ga" in text  # a long name folds instead of being cut to …
