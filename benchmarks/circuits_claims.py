"""SFT against RL from the base through head circuits (issue 21, claim 000), tiny suite.

    python benchmarks/circuits_claims.py runs/claims-circuits

Reads the finished runs of ``benchmarks/configs/claims-circuits.yaml`` (variants ``sft`` and
``rl-base``, one task), exports each seed's two models and finds the head circuits (DBM with hard
straight-through masks) of the shipped base, the SFT model and the RL model, on two partly
retained base behaviours (``facts``, ``upper``) and on the task itself. Writes one record per
seed into ``benchmarks/results/claims-circuits/circuits.json`` (the commit, machine and DBM
settings beside them); a re-run skips the seeds already kept.

``render_circuits`` turns that file into the claims rows of ``docs/claims.md``, paired by seed.
The control for circuit retention is a random circuit of the tuned model's size: it overlaps
the base circuit by |C_model| / H heads on average, so a larger circuit alone raises retention.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from claims_table import interval_cell  # benchmarks/ is on sys.path
from run_all import commit, machine

from forgetless.bench.stats import paired_verdict
from forgetless.core.storage import atomic_write_json

OUT = Path(__file__).parent / "results" / "claims-circuits" / "circuits.json"
BASE = Path(__file__).parents[1] / "src" / "forgetless" / "assets" / "tiny-base"
ARMS = {"sft": "sft", "rl": "rl-base"}
BEHAVIOURS = ("facts", "upper")
TASK = "reverse"
DBM = {"steps": 200, "lr": 0.1, "sparsity": 1.0, "straight_through": True}
"""Fixed on the tuning seed 100: at sparsity 1.0 the base circuits hold 8–9 of the 16 heads at
faithfulness ≥ 0.97; at the default 0.05 they held 11–14, so retention was near 1 by size."""
EXAMPLES = 32
FAITHFUL = 0.5
"""The least mean faithfulness for an arm's circuits to be compared (see ``faithfulness``)."""
KEPT = ("circuit_size", "faithfulness", "retention", "dcm", "n_specialists", "circuit")
SOURCE = "circuits paper"


def _rows(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    labels = ("base", "sft", "rl")
    pairs = zip(labels, data["rows"], strict=True)
    return {label: {k: row.get(k) for k in KEPT} for label, row in pairs}


def diagnose_seed(runs: Path, seed: int) -> dict[str, Any]:
    """The three models' circuits on every behaviour, for one seed."""
    from forgetless.diagnostics.diagnose_circuits import DBMSettings, diagnose_circuits
    from forgetless.training.export import export_model

    settings = DBMSettings(seed=seed, **DBM)  # type: ignore[arg-type]
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        models = [BASE]
        for arm, variant in ARMS.items():
            models.append(Path(scratch) / arm)
            export_model(runs / variant / f"s{seed}", models[-1])
        for behaviour in (*BEHAVIOURS, TASK):
            out = Path(scratch) / f"{behaviour}.json"
            data = diagnose_circuits(models, behaviour, out, EXAMPLES, seed, dbm=settings)
            record[behaviour] = _rows(data)
    return record


def finished_seeds(runs: Path) -> list[int]:
    seeds = []
    for folder in sorted((runs / ARMS["sft"]).glob("s*")):
        twin = runs / ARMS["rl"] / folder.name
        if (folder / "results.json").is_file() and (twin / "results.json").is_file():
            seeds.append(int(folder.name[1:]))
    return seeds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", type=Path, help="the campaign's --out folder")
    args = parser.parse_args(argv)
    kept = json.loads(OUT.read_text(encoding="utf-8")) if OUT.is_file() else {"seeds": {}}
    for seed in finished_seeds(args.runs):
        if str(seed) in kept["seeds"]:
            continue
        print(f"seed {seed}: circuits of base, SFT and RL", file=sys.stderr, flush=True)
        kept["seeds"][str(seed)] = diagnose_seed(args.runs, seed)
        kept.update(commit=commit(), machine=machine(1), dbm=DBM, examples=EXAMPLES)
        atomic_write_json(OUT, kept)
    print(f"{len(kept['seeds'])} seeds kept in {OUT}")


def _heads(row: dict[str, Any]) -> int:
    return sum(len(layer) for layer in row["circuit"])


def above_chance(row: dict[str, Any]) -> float:
    """Retention minus a random circuit's of the same size: |C_model| / H of the base's heads."""
    return float(row["retention"]) - row["circuit_size"] / _heads(row)


def _paired(seeds: list[dict[str, Any]], behaviour: str, value: Any) -> tuple[list, list]:
    rl = [value(s[behaviour]["rl"]) for s in seeds]
    sft = [value(s[behaviour]["sft"]) for s in seeds]
    return rl, sft


def _row(
    claim: str,
    label: str,
    rl: list[float],
    sft: list[float],
    expected: int,
    faithful_note: str = "",
    faithful: bool = True,
) -> str:
    diffs = [a - b for a, b in zip(rl, sft, strict=True)]
    measured = (
        f"{label}: RL {interval_cell(rl)} vs SFT {interval_cell(sft)}; "
        f"paired {interval_cell(diffs)} ({len(diffs)} seeds){faithful_note}"
    )
    verdict = paired_verdict(diffs, expected) if faithful else "not testable here"
    return f"| {claim} | {SOURCE} | {measured} | **{verdict}** |"


def faithfulness(seeds: list[dict[str, Any]], behaviour: str) -> tuple[str, bool]:
    """Both arms' faithfulness as a note, and whether both means reach ``FAITHFUL``: a circuit
    that does not reproduce the behaviour is no circuit of it, so its size or overlap says
    nothing."""
    rl, sft = _paired(seeds, behaviour, lambda r: float(r["faithfulness"] or 0.0))
    ok = min(sum(rl) / len(rl), sum(sft) / len(sft)) >= FAITHFUL
    return f"; faithfulness RL {interval_cell(rl)}, SFT {interval_cell(sft)}", ok


def behaviour_rows(seeds: list[dict[str, Any]], behaviour: str) -> list[str]:
    rows = []
    note, faithful = faithfulness(seeds, behaviour)
    rl, sft = _paired(seeds, behaviour, lambda r: float(r["retention"]))
    claim = f"RL keeps a larger share of the base's `{behaviour}` circuit than SFT"
    rows.append(_row(claim, "retention", rl, sft, 1, note, faithful))
    rl, sft = _paired(seeds, behaviour, above_chance)
    claim += ", beyond a random circuit of the same size"
    rows.append(_row(claim, "retention − size-matched chance", rl, sft, 1, "", faithful))
    rl, sft = _paired(seeds, behaviour, lambda r: float(r["dcm"]))
    claim = f"RL's preserved `{behaviour}` circuit carries more causal signal (DCM) than SFT's"
    rows.append(_row(claim, "DCM (nats)", rl, sft, 1))
    return rows


def render_circuits(folder: Path) -> str:
    """The circuits claims table from ``folder/circuits.json``."""
    lines = ["| claim | source | measured (paired by seed) | verdict |", "|---|---|---|---|"]
    path = folder / "circuits.json"
    kept = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"seeds": {}}
    seeds = list(kept["seeds"].values())
    if not seeds:
        lines.append("| (no circuits kept yet) | | | **not measured** |")
    return "\n".join(lines + render_circuits_rows(seeds)) + "\n"


def render_circuits_rows(seeds: list[dict[str, Any]]) -> list[str]:
    """Every claim row over the kept seeds (none without seeds)."""
    if not seeds:
        return []
    lines = [row for behaviour in BEHAVIOURS for row in behaviour_rows(seeds, behaviour)]
    rl, sft = _paired(seeds, TASK, lambda r: float(r["circuit_size"]))
    claim = f"SFT compresses the `{TASK}` task into fewer heads than RL"
    lines.append(_row(claim, "task circuit size (heads)", rl, sft, 1, *faithfulness(seeds, TASK)))
    return lines


if __name__ == "__main__":
    main()
