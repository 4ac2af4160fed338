"""GCWM's gate, layer by layer, from a merging campaign's kept runs (docs/claims.md).

A block ``<!-- gcwm-gates: CONFIG -->`` … ``<!-- /gcwm-gates -->`` gets one row per GCWM variant
of the campaign: for each transformer layer, the mean gate over that layer's matrices and the
merges of tasks 2 onward, with its 95% interval over the seeds (the unit is the seed), and the
lowest and highest gate any matrix got. Each run records the gate and conflict of every matrix
it merged (``per_task[i].details.gcwm_per_layer``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from claims_table import interval_cell

LAYER = re.compile(r"layers\.(\d+)\.")


def layer_of(matrix: str) -> str:
    """The transformer layer a matrix belongs to (its index), or ``other``."""
    found = LAYER.search(matrix)
    return found.group(1) if found else "other"


def seed_gates(run: dict[str, Any]) -> dict[str, list[float]]:
    """Every gate one run applied, grouped by layer."""
    gates: dict[str, list[float]] = defaultdict(list)
    for task in run.get("results", {}).get("per_task") or []:
        for matrix, entry in ((task.get("details") or {}).get("gcwm_per_layer") or {}).items():
            gates[layer_of(matrix)].append(float(entry["gate"]))
    return gates


def _sort_key(layer: str) -> tuple[int, str]:
    return (int(layer), "") if layer.isdigit() else (1 << 30, layer)


def render_gates(variants: list[str], runs: dict[tuple[str, int], Any]) -> str:
    """The per-layer gate table of every variant whose runs recorded GCWM gates."""
    per_variant: dict[str, list[dict[str, list[float]]]] = defaultdict(list)
    for (variant, _), run in sorted(runs.items()):
        gates = seed_gates(run)
        if gates:
            per_variant[variant].append(gates)
    names = [v for v in variants if v in per_variant]
    layers = sorted({lay for v in names for g in per_variant[v] for lay in g}, key=_sort_key)
    head = "| variant | seeds | " + " | ".join(f"layer {lay}" for lay in layers) + " | range |"
    lines = [head, "|" + "---|" * (len(layers) + 3)]
    for name in names:
        seeds = per_variant[name]
        cells = []
        for lay in layers:
            means = [sum(g[lay]) / len(g[lay]) for g in seeds if g.get(lay)]
            cells.append(interval_cell(means))
        every = [x for g in seeds for values in g.values() for x in values]
        span = f"{min(every):.3f}–{max(every):.3f}"
        lines.append(f"| `{name}` | {len(seeds)} | " + " | ".join(cells) + f" | {span} |")
    if not names:
        lines.append("| (no GCWM run kept yet) | | |")
    return "\n".join(lines) + "\n"
