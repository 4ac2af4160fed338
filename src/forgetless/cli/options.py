"""Command-line option types shared by the command groups."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

PresetOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        help="Built-in preset: tiny or smollm2 (the real-model track); the whole config when "
        "no CONFIG is given (default tiny), else the layer under CONFIG's own keys."
    ),
]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override: key.path=value")]  # noqa: UP045
QuietOpt = Annotated[
    bool,
    typer.Option(
        help="No progress bars: a plain progress line every 30 s instead "
        "(FORGETLESS_PROGRESS_EVERY sets the seconds)."
    ),
]
