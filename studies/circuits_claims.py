"""SFT against RL from the base through head circuits (issue 21, claim 000), at either scale.

    python studies/circuits_claims.py runs/claims-circuits
    python studies/circuits_claims.py runs/real-rl --scale real

Reads the finished runs of the scale's campaign (``studies/configs/claims-circuits.yaml`` on
the tiny suite, ``real-rl.yaml`` on the real track; variants ``sft`` and ``rl-base``, one
task), exports each seed's two models and finds the head circuits (DBM with hard
straight-through masks) of the base, the SFT model and the RL model, on the scale's partly
retained base behaviours and on the task itself. Writes one record per seed into the scale's
``circuits.json`` under ``studies/results/`` (the commit, machine, DBM settings, behaviours
and task beside them); a re-run skips the seeds already kept.

``render_circuits`` turns such a file into the claims rows of ``docs/claims.md``, paired by
seed, over the behaviours and task the file names. The control for circuit retention is a
random circuit of the tuned model's size: it overlaps the base circuit by |C_model| / H heads
on average, so a larger circuit alone raises retention.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
from claims_table import interval_cell  # studies/ is on sys.path
from run_all import commit, machine

from forgetless.bench.cluster import finished_results
from forgetless.bench.stats import paired_verdict
from forgetless.core.storage import atomic_write_json

RESULTS = Path(__file__).parent / "results"
ARMS = {"sft": "sft", "rl": "rl-base"}


@dataclass(frozen=True)
class Scale:
    """Where one scale's circuits come from and how they are found."""

    base: str
    behaviours: tuple[str, ...]
    task: str
    dbm: dict[str, Any]
    examples: int
    out: Path
    effects: str = "exact"
    max_length: int = 64


TINY = Scale(
    base=str(Path(__file__).parents[1] / "src" / "forgetless" / "assets" / "tiny-base"),
    behaviours=("facts", "upper"),
    task="reverse",
    dbm={"steps": 200, "lr": 0.1, "sparsity": 1.0, "straight_through": True},
    examples=32,
    out=RESULTS / "claims-circuits" / "circuits.json",
)
"""DBM fixed on the tuning seed 100: at sparsity 1.0 the base circuits hold 8–9 of the 16
heads at faithfulness ≥ 0.97; at the default 0.05 they held 11–14, so retention was near 1 by
size."""
REAL = Scale(
    base="smollm2-135m-instruct",
    behaviours=("gk-short",),
    task="it-topic",
    dbm={"steps": 40, "lr": 0.25, "sparsity": 0.05, "straight_through": True},
    examples=16,
    out=RESULTS / "real-rl-circuits" / "circuits.json",
    effects="attribution",
    max_length=96,
)
"""The settings `diagnose circuits` was timed at on the real model (docs/real-track.md: first-
order effects, a 40-step DBM at lr 0.25, about 18 minutes for the base and one model), with
hard masks; the free answers are the behaviour SFT on it-topic partly keeps."""
SCALES = {"tiny": TINY, "real": REAL}
FAITHFUL = 0.5
"""The least mean faithfulness for an arm's circuits to be compared (see ``faithfulness``)."""
KEPT = ("circuit_size", "faithfulness", "retention", "dcm", "n_specialists", "circuit")
SOURCE = "circuits paper"


def _rows(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    labels = ("base", "sft", "rl")
    pairs = zip(labels, data["rows"], strict=True)
    return {label: {k: row.get(k) for k in KEPT} for label, row in pairs}


def diagnose_seed(runs: Path, seed: int, scale: Scale) -> dict[str, Any]:
    """The three models' circuits on every behaviour, for one seed."""
    from forgetless.diagnostics.diagnose_circuits import DBMSettings, diagnose_circuits
    from forgetless.training.export import export_model

    settings = DBMSettings(seed=seed, **scale.dbm)
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        models = [Path(scale.base)]
        for arm, variant in ARMS.items():
            models.append(Path(scratch) / arm)
            export_model(runs / variant / f"s{seed}", models[-1])
        for behaviour in (*scale.behaviours, scale.task):
            out = Path(scratch) / f"{behaviour}.json"
            data = diagnose_circuits(
                models,
                behaviour,
                out,
                scale.examples,
                seed,
                dbm=settings,
                max_length=scale.max_length,
                effects=scale.effects,  # type: ignore[arg-type]
            )
            record[behaviour] = _rows(data)
    return record


def finished_seeds(runs: Path) -> list[int]:
    """The seeds whose SFT and RL runs have both finished every task (a run in progress
    already has a ``results.json``)."""
    seeds = []
    for folder in sorted((runs / ARMS["sft"]).glob("s*")):
        twin = runs / ARMS["rl"] / folder.name
        if finished_results(folder) is not None and finished_results(twin) is not None:
            seeds.append(int(folder.name[1:]))
    return seeds


def keep(out: Path, seed: int, record: dict[str, Any], scale: Scale) -> int:
    """Add one seed's record to ``out`` under a lock, re-reading the file first, so that
    processes running other seeds side by side never drop each other's records; the count
    kept."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {"seeds": {}}
        kept["seeds"][str(seed)] = record
        kept.update(
            commit=commit(),
            machine=machine(1),
            dbm=scale.dbm,
            examples=scale.examples,
            effects=scale.effects,
            behaviours=list(scale.behaviours),
            task=scale.task,
        )
        atomic_write_json(out, kept)
        return len(kept["seeds"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", type=Path, help="the campaign's --out folder")
    parser.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    parser.add_argument(
        "--seeds", type=int, nargs="+", help="only these seeds (one process per seed in parallel)"
    )
    args = parser.parse_args(argv)
    scale = SCALES[args.scale]
    out = scale.out
    kept = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {"seeds": {}}
    wanted = finished_seeds(args.runs)
    if args.seeds:
        wanted = [s for s in wanted if s in args.seeds]
    for seed in wanted:
        if str(seed) in kept["seeds"]:
            continue
        print(f"seed {seed}: circuits of base, SFT and RL", file=sys.stderr, flush=True)
        count = keep(out, seed, diagnose_seed(args.runs, seed, scale), scale)
        print(f"seed {seed} kept in {out} ({count} seeds)", file=sys.stderr, flush=True)
    print(f"{len(wanted)} finished seeds asked for; {out}")


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
    digits: int = 3,
) -> str:
    diffs = [a - b for a, b in zip(rl, sft, strict=True)]
    seeds = f"{len(diffs)} seed{'' if len(diffs) == 1 else 's'}"
    cells = [interval_cell(values, digits) for values in (rl, sft, diffs)]
    measured = (
        f"{label}: RL {cells[0]} vs SFT {cells[1]}; paired {cells[2]} ({seeds}){faithful_note}"
    )
    verdict = paired_verdict(diffs, expected) if faithful else "not testable here"
    return f"| {claim} | {SOURCE} | {measured} | **{verdict}** |"


def faithfulness(seeds: list[dict[str, Any]], behaviour: str) -> tuple[str, bool]:
    """Both arms' faithfulness as a note, and whether both means reach ``FAITHFUL``: a circuit
    that does not reproduce the behaviour is no circuit of it, so its size or overlap says
    nothing. Each seed's ratio is capped at 1 (all of the behaviour): where the full model barely
    beats the patched one, the ratio's denominator is near zero and one seed's value would carry
    the mean."""
    rl, sft = _paired(seeds, behaviour, capped_faithfulness)
    ok = min(sum(rl) / len(rl), sum(sft) / len(sft)) >= FAITHFUL
    return f"; faithfulness RL {interval_cell(rl)}, SFT {interval_cell(sft)}", ok


def capped_faithfulness(row: dict[str, Any]) -> float:
    """A circuit's faithfulness in [0, 1]; an undefined ratio (None) counts as none."""
    return min(max(float(row["faithfulness"] or 0.0), 0.0), 1.0)


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
    behaviours = tuple(kept.get("behaviours", TINY.behaviours))
    task = kept.get("task", TINY.task)
    return "\n".join(lines + render_circuits_rows(seeds, behaviours, task)) + "\n"


def render_circuits_rows(
    seeds: list[dict[str, Any]],
    behaviours: tuple[str, ...] = TINY.behaviours,
    task: str = TINY.task,
) -> list[str]:
    """Every claim row over the kept seeds (none without seeds)."""
    if not seeds:
        return []
    lines = [row for behaviour in behaviours for row in behaviour_rows(seeds, behaviour)]
    rl, sft = _paired(seeds, task, lambda r: float(r["circuit_size"]))
    claim = f"SFT compresses the `{task}` task into fewer heads than RL"
    note, faithful = faithfulness(seeds, task)
    lines.append(_row(claim, "task circuit size (heads)", rl, sft, 1, note, faithful, digits=1))
    return lines


if __name__ == "__main__":
    main()
