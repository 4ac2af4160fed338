"""Command-line option types shared by the command groups."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

PresetOpt = Annotated[
    str,
    typer.Option(help="Built-in preset when no CONFIG: tiny or smollm2 (the real-model track)."),
]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override: key.path=value")]  # noqa: UP045
