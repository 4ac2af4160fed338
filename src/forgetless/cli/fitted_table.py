"""A rich table that keeps its row labels and headers whole in a narrow terminal."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.console import Console
from rich.table import Table

UNBOUNDED = 10_000
"""A console width no table reaches, so that measuring gives the width the table wants."""


def _build(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    table = Table(title=title)
    table.add_column(headers[0], no_wrap=True)
    for header in headers[1:]:
        table.add_column(header, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def fitted_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    short: Mapping[str, str],
    width: int,
) -> tuple[Table, str]:
    """The table under its full column names where it fits ``width``; otherwise under the
    ``short`` names, with the legend line that spells them out (empty when not needed)."""
    table = _build(title, columns, rows)
    if Console(width=UNBOUNDED).measure(table).maximum <= width:
        return table, ""
    shortened = [short.get(c, c) for c in columns]
    legend = "; ".join(f"{short[c]}: {c}" for c in columns if c in short)
    return _build(title, shortened, rows), legend
