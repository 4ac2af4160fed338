"""The real-track verdicts campaign, run and judged as its plan declares
(studies/plans/real-verdicts.yaml).

    python studies/verdicts.py configs            # the sweep's config, from the plan
    python studies/verdicts.py run sweep          # forgetless bench on it, resumable; then pack
    python studies/verdicts.py choose             # the measured strengths → order A's config
    python studies/verdicts.py run a              # the measuring seeds, order A
    python studies/verdicts.py order-b            # order B's config: seq_ft + arms judged in A
    python studies/verdicts.py run b
    python studies/verdicts.py render [--check]   # docs/verdicts.md (and claims.md's copy of
                                                  # the family's table) from the kept runs;
                                                  # render_tables.py then redoes the scales
                                                  # tables that quote the family
    python studies/verdicts.py status             # what each stage has landed, seed by seed

Every run lands in runs/campaigns/<config stem>/ (the bench skips what is kept there) and is
packed into studies/results/campaigns/<config stem>.jsonl.gz after each bench. On a lent GPU
the same commands run every arm there; the records name the machine.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean, median
from typing import Any

import yaml
from render_tables import rewrite_verdicts
from runs import CAMPAIGNS, ROOT, UNPACKED, folder_records, pack_path, read_pack
from verdict_judge import (
    Judged,
    comparisons,
    family_tables,
    frontier_lines,
    gain,
    judge_family,
    render,
)
from verdict_then import FIRST, then_and_now_lines

PLAN = ROOT / "studies" / "plans" / "real-verdicts.yaml"
BASE = ROOT / "studies" / "configs" / "real.yaml"
DOC = ROOT / "docs" / "verdicts.md"
CLAIMS = ROOT / "docs" / "claims.md"  # holds the family's table too


def load_plan(path: Path = PLAN) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def config_path(plan: dict[str, Any], stage: str) -> Path:
    return ROOT / plan["test_bed"]["configs"][{"a": "order_a", "b": "order_b"}.get(stage, stage)]


def base_config(plan: dict[str, Any], order: str) -> dict[str, Any]:
    """The real track's run config with the plan's evaluation sizes and task order."""
    cfg = yaml.safe_load(BASE.read_text(encoding="utf-8"))
    cfg.pop("bench")
    cfg["eval"]["between"] = cfg["eval"]["n_eval"]
    tasks = {t if isinstance(t, str) else t["builtin"]: t for t in cfg["tasks"]}
    cfg["tasks"] = [tasks[name] for name in plan["test_bed"][f"tasks_order_{order}"]]
    return cfg


def strengths(method: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The sweep's three strengths of one arm (the plan's rule), each as a named config."""
    sys.path.insert(0, str(ROOT / "src"))
    from forgetless.contract import method_class

    knob = method_class(method["name"]).knob
    if knob.learning_rate:  # no strength of its own: run at its definition
        return [("default", method)]
    default = getattr(method_class(method["name"]).config_cls.model_validate(method), knob.field)
    values = [min(knob.high, max(knob.low, default * f)) for f in (1.0, 0.25, 4.0)]
    options = [(f"{knob.field}={v:g}", {**method, knob.field: v}) for v in dict.fromkeys(values)]
    return [(label, m) for label, m in options if _valid(m)]


def strength_label(method: dict[str, Any]) -> str:
    """A variant's strength as ``knob=value``, its default filled in (``default`` for a
    method whose only knob is the learning rate)."""
    from forgetless.contract import method_class

    cls = method_class(method["name"])
    if cls.knob is None or cls.knob.learning_rate:
        return "default"
    value = getattr(cls.config_cls.model_validate(method), cls.knob.field)
    return f"{cls.knob.field}={value:g}"


def strengths_then_now(plan: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Each family arm's strength in the first real-track campaign and in order A."""
    then, now = (
        {v["name"]: v["method"] for v in yaml.safe_load(path.read_text())["bench"]["variants"]}
        for path in (ROOT / "studies" / "configs" / FIRST, config_path(plan, "a"))
    )
    arms = {c["arm"] for c in comparisons(plan)} | {c["control"] for c in comparisons(plan)}
    return {
        arm: tuple(strength_label(m[arm]) if arm in m else "–" for m in (then, now))  # type: ignore[misc]
        for arm in arms
    }


def _valid(method: dict[str, Any]) -> bool:
    """Whether the method's config takes these settings (replay's task share and its general
    share must leave room in the batch)."""
    from pydantic import ValidationError

    from forgetless.contract import method_class

    try:
        method_class(method["name"]).config_cls.model_validate(method)
    except ValidationError:
        return False
    return True


def sweep_config(plan: dict[str, Any]) -> dict[str, Any]:
    cfg = base_config(plan, plan["sweep"]["order"])
    variants = [{"name": "seq_ft", "method": {"name": "seq_ft"}}]
    for arm, method in plan["arms"].items():
        if arm != plan["control"]:
            variants += [{"name": f"{arm}@{label}", "method": m} for label, m in strengths(method)]
    cfg["bench"] = {"seeds": len(plan["sweep"]["seeds"]), "first_seed": plan["sweep"]["seeds"][0]}
    cfg["bench"]["variants"] = variants
    return cfg


STEP_CHECKPOINTS = 25
"""The measuring runs span sittings: one cut when a sitting ends resumes inside its task from
its last step checkpoint, with the results an uncut run gives (docs/reliability.md)."""


def measuring_config(plan: dict[str, Any], order: str, arms: dict[str, Any]) -> dict[str, Any]:
    cfg = base_config(plan, order)
    cfg["train"]["checkpoint_every"] = STEP_CHECKPOINTS
    seeds = plan["seeds"]["measuring"]
    assert seeds == list(range(seeds[0], seeds[0] + len(seeds))), "measuring seeds run in a row"
    cfg["bench"] = {"seeds": len(seeds), "first_seed": seeds[0]}
    cfg["bench"]["variants"] = [{"name": a, "method": m} for a, m in arms.items()]
    return cfg


def write_config(path: Path, cfg: dict[str, Any], header: str) -> None:
    text = yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True, width=100)
    path.write_text(f"# {header}\n# Written by studies/verdicts.py from {PLAN.name}.\n{text}")
    print(f"wrote {path.relative_to(ROOT)}")


def kept(path: Path) -> dict[str, dict[str, Any]]:
    return read_pack(pack_path(path.stem, CAMPAIGNS))


def gains(records: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """Each variant's gain per kept run (the sweep's tuning seeds), as the plan defines it: the
    diagonal's mean. The library's ``gain`` also subtracts the base row, the same for every arm
    of a seed, so the differences the choice reads are the same under both."""
    out: dict[str, list[float]] = {}
    for run, record in records.items():
        out.setdefault(run.split("/")[1], []).append(gain(record["results"]))
    return out


Option = tuple[str, dict[str, Any], float]  # the strength's label, its config, its tuning gain


def sweep_options(plan: dict[str, Any], sweep: dict[str, list[float]], arm: str) -> list[Option]:
    """The arm's swept strengths that have landed, each with its mean tuning gain."""
    named = [(label, m, f"{arm}@{label}") for label, m in strengths(plan["arms"][arm])]
    return [(label, m, fmean(sweep[key])) for label, m, key in named if key in sweep]


def pick(options: list[Option], target: float, margin: float) -> tuple[Option, bool]:
    """The plan's rule: among the strengths whose gain is within ``margin`` of ``target``, the
    one that keeps most; where none is, the nearest in gain. True when within the margin."""
    within = [o for o in options if abs(o[2] - target) <= margin]
    if within:
        return max(within, key=method_knob_value(within)), True
    return min(options, key=lambda o: abs(o[2] - target)), False


def choose(plan: dict[str, Any], sweep: dict[str, list[float]]) -> dict[str, Any]:
    """The measured strength of each arm: the plan's rule on the sweep's gains."""
    margin, target = plan["test"]["gain_margin"], fmean(sweep[plan["control"]])
    chosen = {plan["control"]: plan["arms"][plan["control"]]}
    for arm in plan["arms"]:
        if arm == plan["control"]:
            continue
        options = sweep_options(plan, sweep, arm)
        if len(options) < len(strengths(plan["arms"][arm])):
            raise SystemExit(f"choose: the sweep has not landed every strength of {arm}")
        chosen[arm] = pick(options, target, margin)[0][1]
    return chosen


def sweep_lines(plan: dict[str, Any], sweep: dict[str, list[float]]) -> list[str]:
    """The sweep's table: each strength's tuning gain against seq_ft's, and the one measured."""
    control, margin = plan["control"], plan["test"]["gain_margin"]
    if control not in sweep:
        return []
    target = fmean(sweep[control])
    lines = [
        "## The strength sweep",
        "",
        f"Order A, tuning seed {', '.join(map(str, plan['sweep']['seeds']))}; {control}'s "
        f"tuning gain {target:.3f}. Each arm is measured at the strength whose gain is within "
        f"±{margin} of it and keeps most; where none is, at the nearest in gain, and it can "
        'only reach "frontier". An arm with a strength still running has none chosen yet.',
        "",
        "| arm | strength | tuning gain | minus seq_ft's | measured |",
        "|---|---|---|---|---|",
    ]
    for arm in plan["arms"]:
        if arm == control:
            continue
        options = sweep_options(plan, sweep, arm)
        done = len(options) == len(strengths(plan["arms"][arm]))
        chosen, within = pick(options, target, margin) if done and options else (None, False)
        for label, _, value in options:
            mark = ""
            if chosen is not None and label == chosen[0]:
                mark = "within the margin" if within else "nearest: frontier only"
            lines.append(f"| {arm} | {label} | {value:.3f} | {value - target:+.3f} | {mark} |")
    return [*lines, ""]


def method_knob_value(options: list[Option]) -> Any:
    """Order options by how much they keep: the knob's value, reversed for a 'lower' knob."""
    from forgetless.contract import method_class

    knob = method_class(options[0][1]["name"]).knob
    sign = 1 if knob.keeps_more == "higher" else -1
    return lambda o: sign * o[1].get(knob.field, 0.0)


def run_stage(plan: dict[str, Any], stage: str, jobs: int) -> int:
    config = config_path(plan, stage)
    stem = config.stem
    bench = [
        sys.executable, "-m", "forgetless", "bench", str(config), "--quiet",
        "--campaign", f"runs/campaigns/{stem}", "--out", f"runs/{stem}", "--jobs", str(jobs),
    ]  # fmt: skip
    subprocess.run([sys.executable, "studies/runs.py", "unpack", stem], cwd=ROOT, check=False)
    code = subprocess.run(bench, cwd=ROOT).returncode
    subprocess.run([sys.executable, "studies/runs.py", "pack", stem], cwd=ROOT, check=True)
    return code


def missing_seeds(cfg: dict[str, Any], runs: set[str]) -> dict[str, list[int]]:
    """Each variant of a stage's config → its seeds with no landed run (``variant/sN``)."""
    first, count = cfg["bench"].get("first_seed", 0), cfg["bench"]["seeds"]
    return {
        v["name"]: [s for s in range(first, first + count) if f"{v['name']}/s{s}" not in runs]
        for v in cfg["bench"]["variants"]
    }


@dataclass(frozen=True)
class Stage:
    """One stage's progress: its label, its config's file name (None before it is written),
    the runs it plans, each variant's seeds with no landed run, and the landed records."""

    label: str
    name: str | None
    planned: int = 0
    missing: dict[str, list[int]] = field(default_factory=dict)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)

    def landed(self) -> str:
        if self.name is None:
            return f"{self.label}: no config yet"
        todo = sum(len(seeds) for seeds in self.missing.values())
        return f"{self.label} ({self.name}): {self.planned - todo} of {self.planned} runs landed"


def stage_progress(plan: dict[str, Any], local: bool) -> list[Stage]:
    """Each stage's progress, from the packs and (with ``local``) the local campaign folder."""
    stages = []
    for stage, label in (("sweep", "the sweep"), ("a", "order A"), ("b", "order B")):
        path = config_path(plan, stage)
        if not path.is_file():
            stages.append(Stage(label, None))
            continue
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
        records = {**kept(path), **(folder_records(UNPACKED / path.stem) if local else {})}
        missing = missing_seeds(cfg, {run.split("/", 1)[1] for run in records})
        planned = len(missing) * cfg["bench"]["seeds"]
        stages.append(Stage(label, path.name, planned, missing, records))
    return stages


def run_seconds(record: dict[str, Any]) -> float:
    """A landed run's training and evaluation time (its start-up not counted)."""
    evals = record["results"].get("eval_seconds") or []
    return float(record["summary"].get("train_seconds") or 0.0) + float(sum(evals))


def hours_left(stage: Stage, jobs: int) -> float | None:
    """The runs still to land, each at its arm's median time so far, shared by ``jobs``
    workers; None while an arm with runs to go has none landed."""
    times: dict[str, list[float]] = {}
    for run, record in stage.records.items():
        times.setdefault(run.split("/")[1], []).append(run_seconds(record))
    todo = [(arm, len(seeds)) for arm, seeds in stage.missing.items() if seeds]
    if any(arm not in times for arm, _ in todo):
        return None
    return sum(median(times[arm]) * count for arm, count in todo) / jobs / 3600


def status_lines(plan: dict[str, Any], jobs: int = 2) -> list[str]:
    """What each stage has landed, packed or in the local campaign folder, the seeds to run,
    and by estimate the hours of runs left."""
    lines = []
    for stage in stage_progress(plan, local=True):
        lines.append(stage.landed())
        lines += [f"  {arm}: seeds {seeds} to run" for arm, seeds in stage.missing.items() if seeds]
        left = hours_left(stage, jobs) if any(stage.missing.values()) else None
        if left is not None:
            lines.append(
                f"  about {left:.1f} h of runs left on {jobs} workers (each arm's median "
                "training and evaluation time so far; start-ups not counted)"
            )
    return lines


def progress_lines(plan: dict[str, Any]) -> list[str]:
    """The page's account of what has landed: the packed runs only, so it renders alike on
    every checkout."""
    stages = [stage.landed() for stage in stage_progress(plan, local=False)]
    return ["## Progress", "", *(f"- {line}" for line in stages), ""]


def judged(plan: dict[str, Any], which: str = "family") -> list[Judged]:
    orders = {o: kept(config_path(plan, o)) for o in ("a", "b")}
    return judge_family(plan, orders, which)


def order_b_arms(
    plan: dict[str, Any], both: list[Judged], chosen: list[dict[str, Any]]
) -> dict[str, Any]:
    """Order B's arms by the plan's rule: the control and every arm (with its control) whose
    order-A verdict is "retains more" or "retains less". Refused while any order-A row is
    still pending or not run, since the rule reads finished verdicts only."""
    unfinished = [
        f"{j.arm} vs {j.control}" for j in both if j.verdict_a.startswith(("pending", "not run"))
    ]
    if unfinished:
        raise SystemExit(f"order-b: order A has not finished {', '.join(unfinished)}")
    judged_a = [j for j in both if j.verdict_a in ("retains more", "retains less")]
    names = {j.arm for j in judged_a} | {j.control for j in judged_a} | {plan["control"]}
    return {v["name"]: copy.deepcopy(v["method"]) for v in chosen if v["name"] in names}


def claims_page(block: str) -> str:
    """docs/claims.md with ``block`` (the family's tables) as its copy of the table."""
    return rewrite_verdicts(CLAIMS.read_text(encoding="utf-8"), block)


def family_block() -> str:
    """Both families' tables as the page prints them, for docs/claims.md's block."""
    plan = load_plan()
    family, second = (judged(plan, w) for w in ("family", "second_family"))
    return "\n".join(family_tables(plan, family, second))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command", choices=["configs", "run", "choose", "order-b", "render", "status"]
    )
    parser.add_argument("stage", nargs="?", choices=["sweep", "a", "b"])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    plan = load_plan()
    if args.command == "configs":
        write_config(config_path(plan, "sweep"), sweep_config(plan), "The strength sweep.")
    elif args.command == "run":
        return run_stage(plan, args.stage or "sweep", args.jobs)
    elif args.command == "choose":
        arms = choose(plan, gains(kept(config_path(plan, "sweep"))))
        write_config(config_path(plan, "a"), measuring_config(plan, "a", arms), "Order A.")
    elif args.command == "status":
        print("\n".join(status_lines(plan)))
    elif args.command == "order-b":
        chosen = yaml.safe_load(config_path(plan, "a").read_text())["bench"]["variants"]
        both = judged(plan) + judged(plan, "second_family")
        cfg = measuring_config(plan, "b", order_b_arms(plan, both, chosen))
        write_config(config_path(plan, "b"), cfg, "Order B.")
    else:
        orders = {o: kept(config_path(plan, o)) for o in ("a", "b")}
        sections = progress_lines(plan) + frontier_lines(plan, orders["a"])
        sections += sweep_lines(plan, gains(kept(config_path(plan, "sweep"))))
        family, second = (judge_family(plan, orders, w) for w in ("family", "second_family"))
        sections += then_and_now_lines(family, strengths_then_now(plan))
        pages = {
            DOC: render(plan, family, second, sections),
            CLAIMS: claims_page("\n".join(family_tables(plan, family, second))),
        }
        if args.check:
            return (
                0 if all(p.is_file() and p.read_text("utf-8") == t for p, t in pages.items()) else 1
            )
        for path, text in pages.items():
            path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
