"""Run every variant over seeds and task orders on the same sequence and budget, then aggregate."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from forgetless.bench.campaign import (
    commit_at_start,
    config_key,
    load_record,
    record_path,
    save_record,
)
from forgetless.bench.cluster import run_on_cluster
from forgetless.bench.jobs import Job, Pace, check_jobs, run_parallel, threads_per_job
from forgetless.bench.stats import MIN_SEEDS, Interval, mean_interval, separated
from forgetless.bench.variants import ClusterSection, Variant, run_folder_name, task_order
from forgetless.config.loading import apply_override, validate_config
from forgetless.config.schema import RunConfig
from forgetless.contract import method_class
from forgetless.core.machine import load_average
from forgetless.core.ownership import mark_folder, marker_record
from forgetless.core.storage import atomic_write_json
from forgetless.errors import ConfigError
from forgetless.eval.metrics import RUN_METRICS
from forgetless.training.outdir import OutDirLock
from forgetless.training.runner import Runner

BENCH_FILE = "bench.json"
METRICS = list(RUN_METRICS)
NOT_FOR_JOINT = {"bwt", "fwt", "forgetting"}


def plan_key(base: dict[str, Any], variants: list[Variant], counts: tuple[int, int, int]) -> str:
    plan = {"base": base, "variants": [v.model_dump() for v in variants], "counts": counts}
    return hashlib.sha256(json.dumps(plan, sort_keys=True, default=str).encode()).hexdigest()[:16]


def claim_plan(
    out_dir: Path, base: dict[str, Any], variants: list[Variant], counts: tuple[int, int, int]
) -> None:
    """Record the bench's plan in its folder's marker; a folder that holds another bench's plan
    is refused, so two benches never share one folder (and one ``bench.json``). A plan that only
    adds variants to the held one (same config, seeds and orders) extends it: the held runs are
    runs of the new plan too."""
    key = plan_key(base, variants, counts)
    held = marker_record(out_dir).get("plan")
    if held and held.get("key") != key and not _extends(held, base, variants, counts):
        raise ConfigError(
            f"{out_dir}: holds a bench of {', '.join(held.get('variants', []))} planned "
            "otherwise (variants, seeds, orders or config); use another --out, so that the two "
            "benches' runs and summaries stay apart"
        )
    mark_folder(out_dir, "bench", plan={"key": key, "variants": [v.name for v in variants]})


def _extends(
    held: dict[str, Any],
    base: dict[str, Any],
    variants: list[Variant],
    counts: tuple[int, int, int],
) -> bool:
    by_name = {v.name: v for v in variants}
    names = held.get("variants", [])
    if not names or any(name not in by_name for name in names):
        return False
    return plan_key(base, [by_name[name] for name in names], counts) == held.get("key")


def folder_name(variant: str) -> str:
    return variant.replace("/", "_").replace(" ", "_")


def check_distinct(variants: list[Variant]) -> None:
    """Each variant once: a name listed twice would be one run folder counted as two runs."""
    names = [v.name for v in variants]
    twice = [n for i, n in enumerate(names) if n in names[:i]]
    if twice:
        raise ConfigError(f"bench: variant {twice[0]!r} is listed twice; list each variant once")


def plan_runs(
    base: dict[str, Any],
    variants: list[Variant],
    seeds: int,
    orders: int,
    out_dir: Path,
    first_seed: int = 0,
) -> list[tuple[Variant, Path, RunConfig]]:
    """Every (variant, seed, order) config, validated before anything runs; the seeds are
    ``first_seed .. first_seed + seeds - 1`` (tuning seeds kept apart from measuring ones).

    Seed by seed, every variant of one seed before the next seed: a bench stopped part-way
    (or resumed over several sittings) leaves each variant with the same seeds, so what has
    landed can already be compared in pairs."""
    check_distinct(variants)
    planned = []
    seed_numbers = range(first_seed, first_seed + seeds)
    for seed, order, variant in itertools.product(seed_numbers, range(orders), variants):
        data = copy.deepcopy(base)
        data.pop("bench", None)  # a run ignores the bench that plans it
        data["seed"], data["method"] = seed, copy.deepcopy(variant.method)
        data["tasks"] = [data["tasks"][i] for i in task_order(len(data["tasks"]), seed, order)]
        for assignment in variant.set:
            apply_override(data, assignment)
        cfg = validate_config(data, f"variant {variant.name}")
        folder = out_dir / folder_name(variant.name) / run_folder_name(seed, order, orders)
        planned.append((variant, folder, cfg))
    return planned


def _run_summary(variant: Variant, folder: Path, results: dict[str, Any]) -> dict[str, Any]:
    metrics = dict(results["metrics"])
    metrics["kl_drift"] = (metrics.get("kl_drift") or {}).get("base_to_model")
    return {
        "variant": variant.name,
        "folder": str(folder),
        "seed": results["config"]["seed"],
        "tasks": results["tasks"],
        "metrics": metrics,
        "train_seconds": sum(t["train_seconds"] for t in results["per_task"]),
        "steps": sum(t["steps"] for t in results["per_task"]),
    }


def aggregate(runs: list[dict[str, Any]], variants: list[Variant]) -> list[dict[str, Any]]:
    """Per variant: mean and 95% interval of each metric, budget, and time relative to seq_ft."""
    rows = []
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant.name]
        joint = getattr(method_class(variant.method["name"]), "joint_training", False)
        row: dict[str, Any] = {
            "variant": variant.name,
            "method": variant.method["name"],
            "runs": len(mine),
            "joint_training": joint,
        }
        for key in METRICS:
            interval = (
                None
                if joint and key in NOT_FOR_JOINT
                else mean_interval([r["metrics"].get(key) for r in mine])
            )
            row[key] = interval.as_dict() if interval else None
        for key in ("train_seconds", "steps"):
            interval = mean_interval([r[key] for r in mine])
            row[key] = interval.as_dict() if interval else None
        budgets = [r["metrics"]["budget"] for r in mine if r["metrics"].get("budget")]
        if budgets:  # how many runs kept their forgetting budget after every task
            row["budget_kept"] = (
                f"{sum(bool(b['kept_every_task']) for b in budgets)} of {len(budgets)}"
            )
        rows.append(row)
    reference = next((r for r in rows if r["method"] == "seq_ft"), None)
    for row in rows:
        base = (
            reference["train_seconds"]["mean"] if reference and reference["train_seconds"] else None
        )
        row["time_vs_seq_ft"] = row["train_seconds"]["mean"] / base if base else None
        other = reference.get("bwt") if reference and row is not reference else None
        row["bwt_vs_seq_ft"] = "reference" if row is reference else compare(row.get("bwt"), other)
    return rows


def compare(value: dict[str, Any] | None, reference: dict[str, Any] | None) -> str:
    """'higher' / 'lower' when the 95% intervals separate, else 'overlap'; 'n/a' without a
    value, and 'too few seeds' below ``MIN_SEEDS`` runs a side (no interval to compare)."""
    if value is None or reference is None:
        return "n/a"
    a, b = (Interval(v["mean"], v["low"], v["high"], v["n"]) for v in (value, reference))
    if min(a.n, b.n) < MIN_SEEDS:
        return "too few seeds"
    if not separated(a, b):
        return "overlap"
    return "higher" if a.mean > b.mean else "lower"


def run_bench(
    base: dict[str, Any],
    variants: list[Variant],
    seeds: int,
    orders: int,
    out_dir: Path,
    console: Console,
    progress: bool = True,
    first_seed: int = 0,
    campaign: Path | None = None,
    jobs: int = 1,
    threads: int | None = None,
    cluster: tuple[str, ClusterSection] | None = None,
) -> dict[str, Any]:
    """Run every planned config; with ``campaign``, keep each finished run there and skip the
    runs kept under the same config (``forgetless.bench.campaign``). ``jobs`` > 1 runs them in
    that many worker processes with ``threads`` CPU threads each (``forgetless.bench.jobs``);
    ``cluster`` (an executor and its job settings) sends each run to a cluster job instead
    (``forgetless.bench.cluster``)."""
    check_jobs(jobs)
    with OutDirLock(out_dir, "bench"):
        claim_plan(out_dir, base, variants, (seeds, orders, first_seed))
        commit_at_start()  # what every record names: the code the bench started with
        planned = plan_runs(base, variants, seeds, orders, out_dir, first_seed)
        summaries: dict[int, dict[str, Any]] = {}
        loads: dict[int, float | None] = {}
        todo: list[Job] = []

        def finished(position: int, results: dict[str, Any]) -> None:
            variant, folder, cfg = planned[position]
            summaries[position] = _run_summary(variant, folder, results)
            kept = campaign and record_path(campaign, folder.parent.name, folder.name)
            if kept:
                save_record(kept, cfg, summaries[position], results, loads.get(position))

        if threads is not None:
            torch.set_num_threads(threads)
        for position, (variant, folder, cfg) in enumerate(planned):
            label = f"bench run {position + 1}/{len(planned)}"
            kept = campaign and record_path(campaign, folder.parent.name, folder.name)
            record = load_record(kept, config_key(cfg)) if kept else None
            if record is not None:
                console.print(f"{label}: {variant.name} kept in {kept}")
                summaries[position] = record["summary"]
            elif jobs > 1 or cluster is not None:
                todo.append((position, cfg.model_dump(mode="json"), folder))
            else:
                console.print(f"[bold]{label}[/]: {variant.name} → {folder}")
                loads[position] = load_average()
                finished(position, Runner(cfg, folder, console, progress=progress).run().to_json())
        if todo:
            pace = Pace(len(todo))

            def announce(position: int, results: dict[str, Any]) -> None:
                finished(position, results)
                variant, folder, _ = planned[position]
                console.print(f"finished {variant.name} → {folder} ({pace.tick()})")

            if cluster is not None:
                kind, spec = cluster
                logs = out_dir / "cluster-logs"
                console.print(f"{len(todo)} runs sent to {kind} jobs (logs in {logs})")
                run_on_cluster(todo, kind, spec, logs, announce)
            else:
                per_job = threads_per_job(jobs, threads)
                console.print(f"{len(todo)} runs on {jobs} workers, {per_job} thread(s) each")
                run_parallel(todo, jobs, per_job, announce, console.quiet)
        runs = [summaries[i] for i in range(len(planned))]
        bench = {
            "schema_version": 1,
            "seeds": seeds,
            "first_seed": first_seed,
            "orders": orders,
            "variants": [v.model_dump() for v in variants],
            "rows": aggregate(runs, variants),
            "runs": runs,
        }
        atomic_write_json(out_dir / BENCH_FILE, bench)
        return bench
