"""The papers' headline claims at both scales, side by side, with each paper's own figure.

``studies/claims_scales.yaml`` lists the claims; each scale points at the row of a rendered
block of docs/claims.md that carries its verdict. A document holds

    <!-- scales-table: claims_scales.yaml -->
    ...
    <!-- /scales-table -->

which ``render_tables.py`` rewrites: one row per claim, each scale's cell the verdict and the
paired difference of the row it points at, re-rendered from the raw data (never read back from
the page), so the summary cannot disagree with the tables under it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

SPECS = Path(__file__).parent
SCALES = ("tiny", "real")
PAIRED = re.compile(r"paired [^;]*")
DECLARED = re.compile(
    r"^([+-]\d+\.\d+ \[[^\]]+\]).*Holm (\d+\.\d+); gain ([+-]\d+\.\d+) .*; n (\d+)$"
)
"""A declared-family cell: its interval, Holm-adjusted p, gain difference and seed count."""
RenderBlock = Callable[[str, str], str]
"""(block kind, block key) → the block's rendered markdown table."""


def row_cells(table: str, lead: list[str], where: str) -> list[str]:
    """The cells of the table row whose leading cells are ``lead``."""
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if cells[: len(lead)] == lead:
            return cells
    raise ValueError(f"{where}: no row starting {lead!r} in the rendered block")


def scale_cell(pointer: dict[str, Any], render_block: RenderBlock, where: str) -> str:
    """A scale's cell: the verdict and paired difference of the row ``pointer`` names."""
    if "missing" in pointer:
        return f"not measured: {pointer['missing']}"
    table = render_block(pointer["block"], pointer["key"])
    cells = row_cells(table, list(pointer["row"]), where)
    if pointer["block"] == "verdicts-family":
        return declared_cell(cells)
    verdict, measured = cells[-1], cells[-2]
    if "not measured" in verdict:
        return verdict
    if pointer.get("exploratory"):
        verdict += " (exploratory)"
    label = measured.split(":", 1)[0]
    found = PAIRED.search(measured)
    detail = found.group(0) if found else measured.split(";", 1)[0].split(": ", 1)[-1]
    return f"{verdict}: {label}, {detail}"


def declared_cell(cells: list[str]) -> str:
    """A declared-family row's cell: its verdict, then each task order's interval and Holm p."""
    orders = []
    for name, cell in zip(("order A", "order B"), cells[1:3], strict=True):
        found = DECLARED.match(cell)
        if found:
            orders.append(f"{name} {found[1]}, Holm {found[2]}, gain {found[3]} ({found[4]} seeds)")
    measured = "; ".join(orders) or "no seeds yet"
    return f"**{cells[-1]}** (declared, Holm): general retention (unclipped), {measured}"


def render_scales(name: str, render_block: RenderBlock) -> str:
    """The side-by-side table of ``studies/<name>``."""
    specs: list[dict[str, Any]] = yaml.safe_load((SPECS / name).read_text(encoding="utf-8"))
    lines = [
        "| paper | claim | the paper reports | tiny suite | real model (SmolLM2-135M) |",
        "|---|---|---|---|---|",
    ]
    for i, spec in enumerate(specs):
        where = f"{name}[{i}] ({spec['claim']})"
        cells = [scale_cell(spec[scale], render_block, where) for scale in SCALES]
        lines.append(
            f"| {spec['paper']} | {spec['claim']} | {spec['paper_figure']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"
