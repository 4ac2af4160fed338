"""Wide CLI tables keep their row labels and headers whole in an 80-column terminal."""

from __future__ import annotations

import io

from rich.console import Console

from forgetless.cli.diagnose import SHORT_COLUMNS
from forgetless.cli.fitted_table import fitted_table
from forgetless.diagnostics.diagnose_circuits import TABLE_COLUMNS

ROWS = [
    ["base", "24", "0.167", "0.912", "1.000", "-", "5", "2.345", "0.123"],
    ["sft/epoch_3", "21", "0.146", "0.871", "0.833", "0.412", "4", "2.101", "-0.123"],
]


def _shown(width: int) -> tuple[str, str]:
    table, legend = fitted_table("Circuits on x", TABLE_COLUMNS, ROWS, SHORT_COLUMNS, width)
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text(), legend


def test_the_circuits_table_fits_80_columns_without_cutting_a_name() -> None:
    text, legend = _shown(80)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "sft/epoch_3" in text and "-0.123" in text
    for column in TABLE_COLUMNS:
        assert column in legend or column in text


def test_a_wide_terminal_keeps_the_full_column_names_and_needs_no_legend() -> None:
    text, legend = _shown(200)
    assert legend == ""
    for column in TABLE_COLUMNS:
        assert column in text
