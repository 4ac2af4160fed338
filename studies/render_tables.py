"""Render the bench tables quoted in the docs from the committed raw results.

A document holds a table between two markers::

    <!-- bench-table: bench-baselines.json -->
    ...
    <!-- /bench-table -->

and this script rewrites what lies between them from ``studies/results/bench-baselines.json``
(mean ± half-width of the 95% t-interval over the seeds, paired differences to ``seq_ft``).

A campaign table (``<!-- campaign-table: real.yaml -->`` … ``<!-- /campaign-table -->``) renders
from the CPU runs kept in ``studies/results/campaigns/<config stem>.jsonl.gz`` (``forgetless bench
--campaign``, packed by ``runs.py``), whatever is there, and names the planned runs still missing;
``<!-- campaign-table: real.yaml seq_ft,replay -->`` renders those variants only.
A tasks table (``<!-- tasks-table: real_tasks.json -->`` … ``<!-- /tasks-table -->``) lists each
instruct task's base accuracy and its accuracy after training on it alone.
A claims table (``<!-- claims-table: SECTION -->`` … ``<!-- /claims-table -->``) renders the
claims of ``studies/claims.yaml`` in that section with verdicts by rule (``claims_table.py``).
A scales table (``<!-- scales-table: claims_scales.yaml -->``) sets each paper's headline claims
at both scales side by side, from the same rows (``claims_scales.py``).
A memory table (``<!-- memory-table: DEVICES -->`` … ``<!-- /memory-table -->``) renders
``memory_model.py``'s bytes per device; a memory check (``<!-- memory-check: FILE -->``) renders
``memory_check.py``'s measured tensors beside the model's. A method-steps block
(``<!-- method-steps: benchmarks/results/FILE -->``) renders a ``method_steps.py`` report as
RESULTS.md does; a step-ratios block (``<!-- step-ratios: FILE -->``) ``remedies_cost.py``'s
steps on SmolLM2-135M; a memory-plan check
(``<!-- memory-plan-check: FOLDER -->``) every ``memory_plan_check.py`` report of
``benchmarks/results/FOLDER/``; a plan-scales block (``<!-- memory-plan-scales: FILE -->``) the
library's memory plan at the model shapes of ``FILE`` (``memory_plan_scales.py``); a verdicts
block (``<!-- verdicts-family: real-verdicts.yaml -->``) the declared real-track family's table
(``verdicts.py``). ``--check`` exits 1 when a document differs from what its data
renders (a test runs it).

    python studies/render_tables.py [--check] [FILES...]
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from budget_claims import render_budget  # studies/ is on sys.path
from circuits_claims import render_circuits
from claims_scales import render_scales
from claims_table import bench_runs, load_claims, render_section
from frontier import figure, frontier_rows, render_frontier
from gcwm_gates import render_gates
from geometry_claims import render_geometry, render_geometry_within
from memory_model import check_table
from memory_model import table as memory_table
from memory_plan_check import render_folder
from memory_plan_scales import render_plan_scales
from runs import kept_record, pack_path, read_pack
from verdict_stats import at_ceiling_or_floor, tost_matched

from forgetless.bench.campaign import config_key
from forgetless.bench.stats import mean_interval, paired_verdict
from forgetless.bench.sweep import plan_runs
from forgetless.bench.variants import BenchSection
from forgetless.eval.metrics import probe_retention_unclipped

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "studies" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- bench-table: (\S+) -->\n)(.*?)(<!-- /bench-table -->)", re.S)
CAMPAIGN = re.compile(
    r"(<!-- campaign-table: (\S+)(?: (\S+))? -->\n)(.*?)(<!-- /campaign-table -->)", re.S
)
TASKS = re.compile(r"(<!-- tasks-table: (\S+) -->\n)(.*?)(<!-- /tasks-table -->)", re.S)
MEMORY = re.compile(r"(<!-- memory-table: (\d+) -->\n)(.*?)(<!-- /memory-table -->)", re.S)
MEMORY_CHECK = re.compile(r"(<!-- memory-check: (\S+) -->\n)(.*?)(<!-- /memory-check -->)", re.S)
PLAN_CHECK = re.compile(
    r"(<!-- memory-plan-check: (\S+) -->\n)(.*?)(<!-- /memory-plan-check -->)", re.S
)
"""The memory plan beside ``gpu_check.py``'s measured peaks, from every report in
``benchmarks/results/FOLDER/`` (``memory_plan_check.py``)."""
CLAIMS_BLOCK = re.compile(r"(<!-- claims-table: (\S+) -->\n)(.*?)(<!-- /claims-table -->)", re.S)
CONFIGS = ROOT / "studies" / "configs"
SECTION = re.compile(r"(<!-- results-section: (\d) -->\n)(.*?)(<!-- /results-section -->)", re.S)
"""A block quoting section N (1-based) of benchmarks/RESULTS.md, which benchmarks/run renders
from benchmarks/RESULTS.json: the README's costs are the benchmarks' own, never retyped."""
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
FRONTIER = re.compile(r"(<!-- frontier-table: (\S+) -->\n)(.*?)(<!-- /frontier-table -->)", re.S)
FIGURES = ROOT / "docs" / "figures"
WITHIN = re.compile(r"(<!-- geometry-within: (\S+) -->\n)(.*?)(<!-- /geometry-within -->)", re.S)
"""Geometry claims from a ``real_geometry.py`` file: correlations inside runs."""
GEOMETRY = re.compile(r"(<!-- geometry-claims: (\S+) -->\n)(.*?)(<!-- /geometry-claims -->)", re.S)
CIRCUITS = re.compile(r"(<!-- circuits-claims: (\S+) -->\n)(.*?)(<!-- /circuits-claims -->)", re.S)
GATES = re.compile(r"(<!-- gcwm-gates: (\S+) -->\n)(.*?)(<!-- /gcwm-gates -->)", re.S)
BUDGET = re.compile(r"(<!-- budget-claims: (\S+) -->\n)(.*?)(<!-- /budget-claims -->)", re.S)
ZERO_MEMORY = re.compile(r"(<!-- zero-memory: (\S+) -->\n)(.*?)(<!-- /zero-memory -->)", re.S)
"""``zero_memory.py``'s count of the optimizer's tensors per process, one line per layout."""
SCALES = re.compile(r"(<!-- scales-table: (\S+) -->\n)(.*?)(<!-- /scales-table -->)", re.S)
"""The papers' claims at both scales side by side (``claims_scales.py``)."""
METHOD_STEPS = re.compile(r"(<!-- method-steps: (\S+) -->\n)(.*?)(<!-- /method-steps -->)", re.S)
"""A ``benchmarks/method_steps.py`` report (path from the repository root) as RESULTS.md's
table of every method against ``seq_ft``, with the machine and its load."""
STEP_RATIOS = re.compile(r"(<!-- step-ratios: (\S+) -->\n)(.*?)(<!-- /step-ratios -->)", re.S)
PEERS = re.compile(r"(<!-- peer-throughput: (\S+) -->\n)(.*?)(<!-- /peer-throughput -->)", re.S)
"""``peer_throughput.py``'s report (benchmarks/results/FILE): the step loop beside TRL and the
transformers Trainer."""
EVAL_SPEED = re.compile(r"(<!-- eval-speed: (\S+) -->\n)(.*?)(<!-- /eval-speed -->)", re.S)
"""``eval_speed.py``'s report (benchmarks/results/FILE): a real-track row, shared head or not."""
"""``remedies_cost.py``'s steps on SmolLM2-135M against ``seq_ft``'s."""
PLAN_SCALES = re.compile(
    r"(<!-- memory-plan-scales: (\S+) -->\n)(.*?)(<!-- /memory-plan-scales -->)", re.S
)
VERDICTS = re.compile(r"(<!-- verdicts-family: (\S+) -->\n)(.*?)(<!-- /verdicts-family -->)", re.S)
AGREEMENT = re.compile(r"(<!-- agreement-table: (\S+) -->\n)(.*?)(<!-- /agreement-table -->)", re.S)
"""Rows of studies/results/scale_out_agreement.json under one layout key (``zero2``, ...)."""
CAMPAIGN_COLUMNS = [
    ("average_accuracy", "avg acc"),
    ("bwt", "BWT"),
    ("kept:gk-mc", "gk-mc retention (unclipped)"),
    ("change:gk-mc", "gk-mc raw change"),
    ("kept:gk-short", "gk-short retention (unclipped)"),
    ("now:chat-format", "chat-format (raw score)"),
    ("prose:kl_base_to_model", "prose KL"),
    ("prose:perplexity", "prose ppl"),
]
COLUMNS = [
    ("average_accuracy", "avg acc"),
    ("bwt", "BWT"),
    ("gain", "gain"),
    ("general_retention", "probe retention (unclipped)"),
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
    """A run's metric; ``probe:NAME`` is a probe's retention as the library reports it (clipped
    to [0, 1]), ``kept:NAME`` the same unclipped and ``change:NAME`` its raw accuracy change
    (``probe_change``), ``general_retention`` the unclipped mean over the probes, ``now:NAME``
    a probe's final score, ``prose:FIELD`` a final prose measure."""
    metrics = run["metrics"]
    kind, _, name = key.partition(":")
    if kind in ("kept", "change"):
        return probe_change(run.get("results") or {}, name, above_chance=kind == "kept")
    if key == "general_retention":
        return general_retention(metrics.get("probe_retention") or {})
    if kind in ("probe", "now"):
        field = "retention" if kind == "probe" else "now"
        value = (metrics.get("probe_retention") or {}).get(name, {}).get(field)
    elif kind == "prose":
        value = (metrics.get("prose") or {}).get(name)
    else:
        value = metrics.get(key)
    return float(value) if isinstance(value, int | float) else None


def general_retention(probes: dict[str, Any]) -> float | None:
    """The library's unclipped mean retention over a run's ``probe_retention`` details (kept
    runs made before the library recorded it have the details only)."""
    found = [p for p in probes.values() if isinstance(p, dict)]
    columns = ([p[k] for p in found] for k in ("base", "now", "chance"))
    return probe_retention_unclipped(*columns)


def probe_change(results: dict[str, Any], name: str, above_chance: bool) -> float | None:
    """Probe ``name`` from a run's first row (the base) to its last: the above-chance ratio
    ``(now − chance) / (base − chance)``, NOT clipped (above 1 when the model gains; None with
    the base at chance), or the raw change ``now − base``."""
    names, rows = results.get("probes") or [], results.get("probe_accuracy") or []
    if name not in names or len(rows) < 2:
        return None
    k = names.index(name)
    base, now = float(rows[0][k]), float(rows[-1][k])
    if not above_chance:
        return now - base
    chance = float((results.get("probe_chance") or [0.0] * len(names))[k])
    return probe_retention_unclipped([base], [now], [chance])


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
        headers += ["retention − seq_ft (paired, unclipped)", "gain − seq_ft (paired)"]
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
            for key in ("general_retention", "gain"):
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


@functools.cache
def _campaign_records(campaign: str) -> dict[str, Any]:
    """A packed campaign's records, read once per process (many blocks read the same one)."""
    return read_pack(pack_path(campaign))


def _kept_runs(config: str) -> tuple[list[str], list[int], dict[tuple[str, int], Any], list[str]]:
    """The campaign's planned variants and seeds, the kept summaries whose config key is the
    one the config plans now (what ``bench --campaign`` would skip), and the stale records."""
    data = yaml.safe_load((CONFIGS / config).read_text(encoding="utf-8"))
    section = BenchSection.model_validate(data.pop("bench", None) or {})
    planned = plan_runs(data, section.variants, section.seeds, 1, Path("."), section.first_seed)
    kept = _campaign_records(Path(config).stem)
    runs, stale = {}, []
    for variant, run_folder, cfg in planned:
        run = f"cpu/{run_folder.parent.name}/{run_folder.name}"
        record = kept_record(kept, run, config_key(cfg))
        if record is not None:
            results = record.get("results") or {}
            keys = (
                "rows",
                "probes",
                "probe_accuracy",
                "probe_chance",
                "kl_drift",
                "eval_seconds",
                "per_task",
            )
            rows = {k: results.get(k) for k in keys}
            sitting = {
                "cpu": (record.get("machine") or {}).get("cpu"),
                "alone": (record.get("contention") or {}).get("shared_cores") is False,
            }
            runs[(variant.name, cfg.seed)] = record["summary"] | {
                "results": rows,
                "sitting": sitting,
            }
        elif run in kept:
            stale.append(f"{variant.name} s{cfg.seed}")
    seeds = list(range(section.first_seed, section.first_seed + section.seeds))
    return [v.name for v in section.variants], seeds, runs, stale


PRIMARY = "kept:gk-mc"
"""The primary retention probe: the question set's multiple-choice form, above chance,
unclipped (a clipped ratio ties every model at or above the base's score at 1)."""
RETENTION_WINDOW = (0.1, 0.9)
"""Where seq_ft's primary retention must fall for the scale to tell methods apart."""


def paired_by_seed(config: str, arm: str, control: str, key: str) -> list[float]:
    """A kept campaign's per-seed differences of ``key``, ``arm`` − ``control`` (empty when
    either variant is not in it)."""
    _, seeds, runs, _ = _kept_runs(config)
    return _paired(runs, arm, seeds, key, control)


def _paired(
    runs: dict[tuple[str, int], Any], name: str, seeds: list[int], key: str, control: str = "seq_ft"
) -> list[float]:
    """Per-seed differences of ``key`` between variant ``name`` and ``control``."""
    return [
        a - b
        for s in seeds
        if (name, s) in runs
        and (control, s) in runs
        and (a := _metric(runs[(name, s)], key)) is not None
        and (b := _metric(runs[(control, s)], key)) is not None
    ]


def _campaign_verdicts(variants: list[str], seeds: list[int], runs: dict[Any, Any]) -> str:
    """seq_ft's primary retention against the window, and each method's paired difference."""
    base = [
        v
        for s in seeds
        if ("seq_ft", s) in runs and (v := _metric(runs[("seq_ft", s)], PRIMARY)) is not None
    ]
    if not base:
        return ""
    found = mean_interval(base)
    assert found is not None
    low, high = RETENTION_WINDOW
    inside = low <= found.low and found.high <= high
    where = "inside" if inside else "not inside"
    spread = (
        "one seed: exploratory"
        if found.n < 2
        else f"{found.n} seeds; 95% interval [{found.low:.3f}, {found.high:.3f}], {where} the "
        f"{low:.0%}–{high:.0%} window"
    )
    probe = [
        runs[("seq_ft", s)]["metrics"]["probe_retention"]["gk-mc"]
        for s in seeds
        if ("seq_ft", s) in runs
    ]
    score = sum(p["base"] for p in probe) / len(probe)
    compared = sum(
        1 for name in variants if name != "seq_ft" and _paired(runs, name, seeds, PRIMARY)
    )
    lines = [
        f"\n`seq_ft` keeps {_fmt(*interval(base))} of the base's above-chance `gk-mc` score, "
        f"unclipped (base {score:.3f} against chance {probe[0]['chance']:.2f}; {spread}). "
        f"Each line below is one paired interval, not adjusted for the {compared} comparisons: "
        "exploratory (the declared family, with Holm, is `studies/plans/real-verdicts.yaml`)."
    ]
    for name in variants:
        diffs = _paired(runs, name, seeds, PRIMARY)
        if name == "seq_ft" or not diffs:
            continue
        verdict = paired_verdict(diffs, expected=1)
        said = {"supported": "retains more", "refuted": "retains less"}.get(verdict, verdict)
        lines.append(
            f"`{name}` against `seq_ft`, paired: {_fmt(*interval(diffs))} ({said})"
            f"{_gain_clause(_paired(runs, name, seeds, 'gain'))}."
        )
    return "\n".join(lines) + "\n"


MATCHED_GAIN = 0.05
"""A retention comparison is at matched learning when the paired gain differs by less than this
(the verdicts plan's margin), shown by TOST: both one-sided t-tests at 0.05, i.e. the 90%
interval of the mean paired difference inside ±0.05 (issue 49: an interval read by eye, or a
mean alone, is no matching criterion)."""


def gain_match(gains: list[float]) -> str:
    """Whether the paired new-task gains make a matched pair, by TOST at ``MATCHED_GAIN``."""
    mean, _, n = interval(gains)
    if n < 2:
        return "not testable on one seed"
    if tost_matched(gains, MATCHED_GAIN):
        return f"matched (TOST within {MATCHED_GAIN})"
    where = "its mean beyond" if abs(mean) >= MATCHED_GAIN else "its 90% interval reaches past"
    return f"not matched (TOST: {where} {MATCHED_GAIN})"


def _gain_clause(gains: list[float]) -> str:
    """The paired new-task gain difference, and whether the retention comparison is matched."""
    if not gains:
        return ""
    return f", at a new-task gain {_fmt(*interval(gains))} from `seq_ft`'s: {gain_match(gains)}"


def _time_ratio(mine: list[dict[str, Any]], control: list[dict[str, Any]]) -> str:
    """Mean training time over ``control``'s, only where every run of both ran on one CPU model
    with the cores to itself (its record says so); else "–" (issue 49)."""
    both = mine + control
    cpus = {r["sitting"]["cpu"] for r in both}
    if not control or len(cpus) != 1 or not all(r["sitting"]["alone"] for r in both):
        return "–"
    return f"{_train_seconds(mine) / _train_seconds(control):.2f}"


def _train_seconds(runs: list[dict[str, Any]]) -> float:
    return sum(r["train_seconds"] for r in runs) / len(runs)


def render_campaign(config: str, only: list[str] | None = None) -> str:
    """The kept runs of a campaign as a table, then the planned runs not kept yet; ``only``: these
    of its variants, in this order (``seq_ft`` among them for the paired columns)."""
    variants, seeds, runs, stale = _kept_runs(config)
    if only is not None:
        unknown = sorted(set(only) - set(variants))
        if unknown:
            raise SystemExit(f"campaign-table {config}: no variant {', '.join(unknown)}")
        variants = only
        stale = [s for s in stale if s.rsplit(" ", 1)[0] in only]
    headers = ["variant", "runs", *(label for _, label in CAMPAIGN_COLUMNS)]
    headers += ["gk-mc retention − seq_ft (paired, unclipped)", "time vs seq_ft (alone)"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    base = [r for (v, _), r in runs.items() if v == "seq_ft"]
    for name in variants:
        mine = [runs[(name, s)] for s in seeds if (name, s) in runs]
        if not mine:
            continue
        cells = [name, str(len(mine))]
        for key, _ in CAMPAIGN_COLUMNS:
            values = [v for r in mine if (v := _metric(r, key)) is not None]
            cells.append(_fmt(*interval(values)) if values else "n/a")
        diffs = _paired(runs, name, seeds, PRIMARY)
        cells.append(_fmt(*interval(diffs)) if diffs and name != "seq_ft" else "–")
        cells.append(_time_ratio(mine, base))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(_campaign_verdicts(variants, seeds, runs).rstrip("\n"))
    missing = [f"{v} s{s}" for v in variants for s in seeds if (v, s) not in runs]
    total = len(variants) * len(seeds)
    note = (
        f"\nStill missing ({len(missing)} of {total} runs): {', '.join(missing)}"
        if missing
        else f"\nAll {total} runs are kept"
    )
    if stale:
        note += (
            f". Kept under an older config (left out, re-run by the campaign): {', '.join(stale)}"
        )
    return "\n".join(lines) + "\n" + note + ".\n"


def render_agreement(layout: str) -> str:
    """2 processes against 1, per method, as ``scale_out_agreement.py`` measured them."""
    report = json.loads((RESULTS / "scale_out_agreement.json").read_text(encoding="utf-8"))
    lines = [
        "| method | steps compared | max abs loss diff | max rel loss diff | "
        "max abs diff, final weights and state |",
        "|---|---|---|---|---|",
    ]
    for name, row in report[layout].items():
        cells = [f"{row[k]:.1e}" for k in ("max_abs_loss_diff", "max_rel_loss_diff")]
        cells.append(f"{row['max_abs_state_diff']:.1e}")
        lines.append(f"| {name} | {row['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_zero_memory(name: str) -> str:
    report = json.loads((RESULTS / name).read_text(encoding="utf-8"))
    n = report["trainable"]
    rows = [("1 process", [report["single"]])]
    rows += [(f"ZeRO-{k[-1]}, 2 processes", report[k]) for k in ("zero1", "zero2")]
    lines = [
        "| layout | AdamW moments per process | float32 master copy per process "
        "| in trainable weights |",
        "|---|---|---|---|",
    ]
    for label, procs in rows:
        moments = " / ".join(f"{r['moments']:,}" for r in procs)
        master = " / ".join(f"{r['master']:,}" for r in procs)
        held = max(r["moments"] + r["master"] for r in procs) / n
        lines.append(f"| {label} | {moments} | {master} | {held:.2f} |")
    return "\n".join(lines) + "\n"


def render_method_steps(path: str) -> str:
    report = json.loads((ROOT / path).read_text(encoding="utf-8"))
    return method_steps_table(report, Path(path).name)


def method_steps_table(report: dict[str, Any], name: str) -> str:
    """RESULTS.md's table of every method against ``seq_ft``, then how and where it was timed
    (the 1-minute load average tells whether other jobs shared the cores)."""
    from results_table import _methods_md  # benchmarks/ is on sys.path (circuits_claims)

    m, s, load = report["machine"], report["settings"], report["load_average"]
    lines = _methods_md(report)
    lines.append(
        f"\n{s['repeats']} repeats of {s['warmup']} warm-up + {s['steps']} timed steps, batch "
        f"{s['batch_size']} (`{name}`); on {m['cpu']} ({m['cores']} cores, {m['torch_threads']} "
        f"torch thread(s), torch {m['torch']}), 1-minute load average {load['before']:.1f} "
        f"before, {load['after']:.1f} after."
    )
    return "\n".join(lines) + "\n"


def render_step_ratios(name: str) -> str:
    from remedies_cost import render_steps  # imports the model stack: only when quoted

    return render_steps(json.loads((RESULTS / name).read_text(encoding="utf-8")))


def render_peers(name: str) -> str:
    from peer_throughput import render_table  # benchmarks/ is on sys.path (circuits_claims)

    path = ROOT / "benchmarks" / "results" / name
    return render_table(json.loads(path.read_text(encoding="utf-8")))


def rewrite_verdicts(text: str, block: str | None = None) -> str:
    """``text`` with its verdicts-family blocks rendered afresh, or set to ``block`` where the
    caller has judged the family already (the other blocks untouched)."""

    def fill(match: re.Match[str]) -> str:
        body = block if block is not None else render_verdicts(match.group(2))
        return match.group(1) + body + match.group(4)

    return VERDICTS.sub(fill, text)


def render_verdicts(plan: str) -> str:
    """The declared real-track family's verdicts, as docs/verdicts.md prints them."""
    from verdicts import PLAN, family_block  # imports this module: only when quoted

    if PLAN.name != plan:
        raise ValueError(f"verdicts-family: {plan} is not the plan verdicts.py reads")
    return family_block()


def render_eval_speed(name: str) -> str:
    from eval_speed import render_table  # benchmarks/ is on sys.path (circuits_claims)

    path = ROOT / "benchmarks" / "results" / name
    return render_table(json.loads(path.read_text(encoding="utf-8"))) + "\n"


def render_tasks(name: str) -> str:
    if not (RESULTS / name).is_file():
        return f"Not measured yet: `studies/results/{name}` is not there.\n"
    report = json.loads((RESULTS / name).read_text(encoding="utf-8"))
    lines = ["| task | skill | base | after training on it alone |", "|---|---|---|---|"]
    for task, row in report["tasks"].items():
        lines.append(f"| `{task}` | {row['skill']} | {row['base']:.2f} | {row['alone']:.2f} |")
    return "\n".join(lines) + "\n"


def rewrite(text: str) -> str:
    def table(match: re.Match[str]) -> str:
        bench = json.loads((RESULTS / match.group(2)).read_text(encoding="utf-8"))
        return match.group(1) + render(bench) + match.group(4)

    def campaign(match: re.Match[str]) -> str:
        only = match.group(3).split(",") if match.group(3) else None
        return match.group(1) + render_campaign(match.group(2), only) + match.group(5)

    def tasks(match: re.Match[str]) -> str:
        return match.group(1) + render_tasks(match.group(2)) + match.group(4)

    block = functools.cache(render_block)  # the scales table re-reads the claims blocks

    def claims(match: re.Match[str]) -> str:
        return match.group(1) + block("claims-table", match.group(2)) + match.group(4)

    def memory(match: re.Match[str]) -> str:
        return match.group(1) + memory_table(int(match.group(2))) + match.group(4)

    def checked(match: re.Match[str]) -> str:
        report = json.loads((RESULTS / match.group(2)).read_text(encoding="utf-8"))
        return match.group(1) + check_table(report) + match.group(4)

    def section(match: re.Match[str]) -> str:
        return match.group(1) + results_section(int(match.group(2))) + match.group(4)

    def budget(match: re.Match[str]) -> str:
        _, seeds, runs, _ = _kept_runs(match.group(2))
        return match.group(1) + render_budget(runs, seeds, match.group(2)) + match.group(4)

    def frontier(match: re.Match[str]) -> str:
        rows, dropped = _frontier(match.group(2))
        return match.group(1) + render_frontier(rows) + _frontier_note(dropped) + match.group(4)

    def geometry(match: re.Match[str]) -> str:
        return match.group(1) + block("geometry-claims", match.group(2)) + match.group(4)

    def within(match: re.Match[str]) -> str:
        return match.group(1) + block("geometry-within", match.group(2)) + match.group(4)

    def circuits(match: re.Match[str]) -> str:
        return match.group(1) + block("circuits-claims", match.group(2)) + match.group(4)

    def gates(match: re.Match[str]) -> str:
        variants, _, runs, _ = _kept_runs(match.group(2))
        return match.group(1) + render_gates(variants, runs) + match.group(4)

    text = CIRCUITS.sub(circuits, GEOMETRY.sub(geometry, FRONTIER.sub(frontier, text)))
    text = WITHIN.sub(within, GATES.sub(gates, text))
    text = TASKS.sub(tasks, CAMPAIGN.sub(campaign, BLOCK.sub(table, text)))
    text = SECTION.sub(section, MEMORY.sub(memory, CLAIMS_BLOCK.sub(claims, text)))

    def agreement(match: re.Match[str]) -> str:
        return match.group(1) + render_agreement(match.group(2)) + match.group(4)

    def zero_memory(match: re.Match[str]) -> str:
        return match.group(1) + render_zero_memory(match.group(2)) + match.group(4)

    def scales(match: re.Match[str]) -> str:
        return match.group(1) + render_scales(match.group(2), block) + match.group(4)

    text = SCALES.sub(scales, ZERO_MEMORY.sub(zero_memory, AGREEMENT.sub(agreement, text)))

    def steps(match: re.Match[str]) -> str:
        return match.group(1) + render_method_steps(match.group(2)) + match.group(4)

    def ratios(match: re.Match[str]) -> str:
        return match.group(1) + render_step_ratios(match.group(2)) + match.group(4)

    text = STEP_RATIOS.sub(ratios, METHOD_STEPS.sub(steps, text))
    text = PEERS.sub(lambda m: m.group(1) + render_peers(m.group(2)) + m.group(4), text)
    text = rewrite_verdicts(text)
    text = PLAN_SCALES.sub(lambda m: m.group(1) + render_plan_scales(m.group(2)) + m.group(4), text)
    text = EVAL_SPEED.sub(lambda m: m.group(1) + render_eval_speed(m.group(2)) + m.group(4), text)

    def plan_checked(match: re.Match[str]) -> str:
        return match.group(1) + render_folder(match.group(2)) + match.group(4)

    text = PLAN_CHECK.sub(plan_checked, text)
    return MEMORY_CHECK.sub(checked, BUDGET.sub(budget, text))


def render_block(kind: str, key: str) -> str:
    """The markdown a claims, geometry, circuits or declared-family block of that key renders."""
    if kind == "claims-table":
        return render_section(key, load_claims(), _claim_runs, _metric)
    if kind == "geometry-claims":
        return render_geometry(RESULTS / key)
    if kind == "geometry-within":
        return render_geometry_within(RESULTS / key)
    if kind == "circuits-claims":
        return render_circuits(RESULTS / key)
    if kind == "verdicts-family":
        return render_verdicts(key)
    raise ValueError(f"claims_scales.yaml: no block kind {kind!r}")


def results_section(number: int) -> str:
    """Section ``number`` of benchmarks/RESULTS.md (its ``## `` title and everything under it)."""
    parts = re.split(r"(?m)^(?=## )", RESULTS_MD.read_text(encoding="utf-8"))[1:]
    if not 1 <= number <= len(parts):
        raise ValueError(f"benchmarks/RESULTS.md has no section {number}")
    body = parts[number - 1].split("\n", 1)[1].strip("\n")
    return body + "\n"


def _frontier(config: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The frontier's rows, and the probes its retention leaves out."""
    variants, seeds, runs, _ = _kept_runs(config)
    probes, dropped = _retained_probes(runs)
    metric = functools.partial(_general_metric, probes=probes)
    return frontier_rows(variants, seeds, runs, metric), dropped


def _retained_probes(runs: dict[tuple[str, int], Any]) -> tuple[list[str], list[str]]:
    """The campaign's probes, split into those kept and those at ceiling or floor in every run
    (base and final rows), which the verdicts plan's drop rule leaves out of aggregates."""
    kept: list[str] = []
    dropped: list[str] = []
    results = [r["results"] for r in runs.values() if (r.get("results") or {}).get("probes")]
    for name in dict.fromkeys(p for r in results for p in r["probes"]):
        found = [r for r in results if name in r["probes"] and len(r["probe_accuracy"]) > 1]
        if not found:
            continue
        k = found[0]["probes"].index(name)
        scores = [
            row[k] for r in found for row in (r["probe_accuracy"][0], r["probe_accuracy"][-1])
        ]
        chance = (found[0].get("probe_chance") or [0.0] * (k + 1))[k]
        (dropped if at_ceiling_or_floor(scores, chance) else kept).append(name)
    return kept, dropped


def _general_metric(run: dict[str, Any], key: str, probes: list[str]) -> float | None:
    """``_metric``, but ``retention`` is the mean unclipped above-chance retention over
    ``probes`` (the library's summary clips each probe to [0, 1])."""
    if key != "retention":
        return _metric(run, key)
    found = [
        v for p in probes if (v := probe_change(run.get("results") or {}, p, True)) is not None
    ]
    return sum(found) / len(found) if found else None


def _frontier_note(dropped: list[str]) -> str:
    if not dropped:
        return ""
    names = ", ".join(f"`{p}`" for p in dropped)
    return f"\nProbe retention leaves out {names}: at ceiling or floor in every run.\n"


def draw_frontiers(text: str) -> None:
    """Draw every frontier block of ``text`` as docs/figures/<config stem>-frontier.png."""
    for match in FRONTIER.finditer(text):
        figure(_frontier(match.group(2))[0], FIGURES / f"{Path(match.group(2)).stem}-frontier.png")


def _claim_runs(claim: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    data = claim["data"]
    if "bench" in data:
        return bench_runs(RESULTS, data["bench"])
    return _kept_runs(data["campaign"])[2]


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
        if not args.check:
            draw_frontiers(new)
    if args.check and stale:
        print("stale tables: " + ", ".join(str(p) for p in stale), file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
