"""Bench: variants, intervals, the side-by-side run, and the report it writes."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import tiny_run_config
from rich.console import Console

from forgetless.bench.jobs import pace_text
from forgetless.bench.stats import mean_interval, separated
from forgetless.bench.sweep import plan_runs
from forgetless.bench.variants import Variant, parse_variant, select_variants, task_order
from forgetless.cli.app import main, split_variants
from forgetless.config.loading import validate_config
from forgetless.errors import ConfigError
from forgetless.report.plots import pareto_front
from forgetless.report.render import write_report
from forgetless.training.runner import Runner


def test_mean_interval_matches_student_t() -> None:
    interval = mean_interval([1.0, 2.0, 3.0])
    assert interval is not None
    assert interval.mean == pytest.approx(2.0)
    assert interval.high - interval.mean == pytest.approx(4.303 * 1.0 / 3**0.5, rel=1e-3)
    single = mean_interval([0.5])
    assert single is not None and single.low == single.high == 0.5
    assert mean_interval([]) is None


def test_separated_needs_three_runs_and_no_overlap() -> None:
    a, b = mean_interval([0.1, 0.11, 0.12]), mean_interval([0.5, 0.52, 0.51])
    assert separated(a, b)
    assert not separated(a, mean_interval([0.1, 0.6, 0.35]))
    assert not separated(mean_interval([0.1]), b)
    assert not separated(mean_interval([0.1, 0.1001]), b)  # apart, but two runs decide nothing


def test_variant_syntax() -> None:
    variant = parse_variant("seq_ft@train.lr=1e-4,foo=2")
    assert variant.method == {"name": "seq_ft"}
    assert variant.set == ["train.lr=1e-4", "method.foo=2"]
    assert split_variants("seq_ft,kl_sft@beta=0.5,gamma=1,ewc") == [
        "seq_ft",
        "kl_sft@beta=0.5,gamma=1",
        "ewc",
    ]
    with pytest.raises(ConfigError, match="key=value"):
        parse_variant("seq_ft@oops")


def test_methods_pick_the_configs_variants_by_name() -> None:
    named = [Variant(name="sae_fd-dense", method={"name": "sae_fd", "space": "dense"})]
    picked = select_variants(["sae_fd-dense", "kl_sft@beta=0.5"], named)
    assert picked[0] is named[0]  # the config's variant, its settings kept
    assert picked[1].method == {"name": "kl_sft"} and picked[1].set == ["method.beta=0.5"]


def test_task_orders_are_seeded_permutations() -> None:
    assert task_order(4, seed=0, order=0) == [0, 1, 2, 3]
    drawn = task_order(4, seed=0, order=1)
    assert sorted(drawn) == [0, 1, 2, 3] and drawn == task_order(4, seed=0, order=1)


def test_a_bench_runs_seed_by_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Stopped part-way, a bench has run every variant on the same seeds."""
    variants = select_variants(["seq_ft", "replay", "ewc"], [])
    planned = plan_runs(tiny_run_config(tiny_model_dir), variants, 2, 1, tmp_path, first_seed=7)
    order = [(cfg.seed, variant.name) for variant, _, cfg in planned]
    assert order == [
        (7, "seq_ft"),
        (7, "replay"),
        (7, "ewc"),
        (8, "seq_ft"),
        (8, "replay"),
        (8, "ewc"),
    ]


def test_pareto_front() -> None:
    assert pareto_front([(0.1, 0.9), (0.5, 0.5), (0.4, 0.4), (0.9, 0.1)]) == [0, 1, 3]


def test_bench_runs_variants_and_writes_report(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump(tiny_run_config(tiny_model_dir)), encoding="utf-8")
    out = tmp_path / "out"
    argv = [
        "forgetless",
        "bench",
        str(config),
        "--methods",
        "seq_ft,seq_ft@train.lr=1e-4",
        "--seeds",
        "2",
        "--out",
        str(out),
        "--quiet",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    main()
    bench = json.loads((out / "bench.json").read_text())
    assert [r["variant"] for r in bench["rows"]] == ["seq_ft", "seq_ft@train.lr=1e-4"]
    assert all(r["runs"] == 2 for r in bench["rows"])
    assert bench["rows"][0]["time_vs_seq_ft"] == pytest.approx(1.0)
    assert (out / "seq_ft" / "s1" / "results.json").is_file()
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "seq_ft@train.lr=1e-4" in html
    assert (out / "plots" / "tradeoff.png").stat().st_size > 1000
    assert "| seq_ft |" in (out / "report.md").read_text()


def test_run_report(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_run_config(tiny_model_dir)), encoding="utf-8")
    monkeypatch.setattr(
        sys, "argv", ["forgetless", "run", str(config), "--out", str(tmp_path / "r"), "--quiet"]
    )
    main()
    monkeypatch.setattr(sys, "argv", ["forgetless", "report", str(tmp_path / "r")])
    main()
    html = (tmp_path / "r" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4
    for name in ["accuracy_matrix", "task_curves", "kl_drift", "forgetting"]:
        assert (tmp_path / "r" / "plots" / f"{name}.png").is_file()
    markdown = (tmp_path / "r" / "report.md").read_text()
    time_rows = markdown.split("Where the time went")[1].split("\n## ")[0]
    assert "| base |" in time_rows and "| reverse |" in time_rows and "loglik" in time_rows


def test_compare_reports_only_separated_intervals() -> None:
    from forgetless.bench.sweep import compare

    low = {"mean": -0.9, "low": -0.95, "high": -0.85, "n": 3}
    high = {"mean": -0.2, "low": -0.3, "high": -0.1, "n": 3}
    near = {"mean": -0.88, "low": -0.99, "high": -0.8, "n": 3}
    assert compare(high, low) == "higher" and compare(low, high) == "lower"
    assert compare(near, low) == "overlap" and compare(None, low) == "n/a"
    assert compare({**high, "n": 2}, low) == "too few seeds"  # two runs give no interval


def test_campaign_keeps_runs_and_skips_what_is_kept(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    from forgetless.bench import sweep

    base = tiny_run_config(tiny_model_dir, tasks=["reverse"])
    variants = [parse_variant("seq_ft")]
    kept = tmp_path / "kept"
    first = sweep.run_bench(
        base, variants, 2, 1, tmp_path / "a", Console(quiet=True), False, 0, kept
    )
    records = sorted(kept.glob("cpu/seq_ft/*.json"))
    assert [p.name for p in records] == ["s0.json", "s1.json"]
    record = json.loads(records[0].read_text(encoding="utf-8"))
    assert record["commit"] is None or len(record["commit"]) == 40
    assert record["machine"]["device"] == "cpu" and record["results"]["status"] == "complete"

    class NoRun:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("a kept run ran again")

    monkeypatch.setattr(sweep, "Runner", NoRun)
    again = sweep.run_bench(
        base, variants, 2, 1, tmp_path / "b", Console(quiet=True), False, 0, kept
    )
    assert again["runs"] == first["runs"]

    changed = json.loads(json.dumps(base))
    changed["train"]["lr"] = 2e-3  # another config: the kept runs no longer stand for it
    with pytest.raises(AssertionError, match="ran again"):
        sweep.run_bench(
            changed, variants, 1, 1, tmp_path / "c", Console(quiet=True), False, 0, kept
        )


def test_a_campaign_record_names_the_planned_config_when_the_run_steers_its_knob(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A budget steers EWC's λ inside the run; the record (run in this process) keeps the
    config it was planned with, so a re-run finds it kept."""
    from rich.console import Console

    from forgetless.bench import sweep
    from forgetless.bench.campaign import config_key
    from forgetless.config.loading import validate_config

    method = {"name": "ewc", "lam": 100.0, "fisher_samples": 4, "fisher_batch_size": 4}
    budget = {"metric": "kl_to_base", "max_loss": 1e-9, "check_every": 2, "probe_batch": 8}
    budget["on_violation"] = "steer"
    base = tiny_run_config(tiny_model_dir, tasks=["reverse"], method=method, budget=budget)
    kept = tmp_path / "kept"
    sweep.run_bench(
        base,
        [Variant(name="ewc", method=method)],
        1,
        1,
        tmp_path / "a",
        Console(quiet=True),
        False,
        0,
        kept,
    )
    record = json.loads((kept / "cpu" / "ewc" / "s0.json").read_text(encoding="utf-8"))
    trace = record["results"]["per_task"][0]["budget"]["trace"]
    assert trace[-1]["value"] > 100.0  # the run did steer λ up
    assert record["config"]["method"]["lam"] == 100.0
    assert record["config_key"] == config_key(validate_config(base, "planned"))


def test_jobs_give_the_sequential_table(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two worker processes, one thread per run: the same runs, metrics and order as one."""
    from rich.console import Console

    from forgetless.bench import sweep

    base = tiny_run_config(tiny_model_dir, tasks=["reverse"])
    variants = [parse_variant("seq_ft")]
    quiet = Console(quiet=True)
    kept = tmp_path / "kept"
    one = sweep.run_bench(base, variants, 2, 1, tmp_path / "one", quiet, False, threads=1)
    said = Console(record=True, width=300, file=io.StringIO())
    two = sweep.run_bench(
        base, variants, 2, 1, tmp_path / "two", said, False, campaign=kept, jobs=2, threads=1
    )
    lines = [line for line in said.export_text().splitlines() if line.startswith("finished")]
    assert len(lines) == 2 and "(1 of 2 runs; about " in lines[0] and "left at the pace" in lines[0]
    assert lines[1].endswith("(2 of 2 runs)")

    def strip(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in ("folder", "train_seconds")} for r in runs]

    assert strip(two["runs"]) == strip(one["runs"])
    assert [r["seed"] for r in two["runs"]] == [0, 1]
    assert len(list(kept.glob("cpu/*/s*.json"))) == 2  # kept by the parent as each finished
    for seed in (0, 1):  # each run's own output, progress included, in a log one can follow
        log = (tmp_path / "two" / "worker-logs" / f"seq_ft-s{seed}.log").read_text("utf-8")
        assert "task 1/1" in log.lower() and "step" in log


@pytest.mark.parametrize(
    ("raised", "logged"),
    [
        (KeyboardInterrupt(), "interrupted: the run stopped here"),
        (RuntimeError("boom"), "Traceback"),
    ],
)
def test_a_workers_log_ends_with_what_stopped_its_run(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    raised: BaseException,
    logged: str,
) -> None:
    """A Ctrl-C leaves one line in the run's log; a fault leaves its traceback."""
    from forgetless.bench import jobs
    from forgetless.training.runner import Runner

    def stop(self: Runner) -> None:
        raise raised

    monkeypatch.setattr(Runner, "run", stop)
    folder = tmp_path / "bench" / "seq_ft" / "s0"
    with pytest.raises(type(raised)):
        jobs.run_job(tiny_run_config(tiny_model_dir), str(folder), threads=1, quiet=True)
    text = jobs.worker_log(folder).read_text("utf-8")
    assert text.startswith(logged)
    assert ("Traceback" in text) == isinstance(raised, Exception)


def test_jobs_are_refused_under_a_distributed_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    from forgetless.bench import sweep

    monkeypatch.setenv("WORLD_SIZE", "2")
    base, quiet = tiny_run_config(tmp_path / "model", tasks=["reverse"]), Console(quiet=True)
    with pytest.raises(ConfigError, match="not under a distributed launch"):
        sweep.run_bench(base, [parse_variant("seq_ft")], 1, 1, tmp_path, quiet, jobs=2)


def test_a_budgeted_bench_says_how_many_runs_kept_it(tmp_path: Path) -> None:
    from forgetless.report.render import sections_for_bench

    def run(variant: str, seed: int, kept: bool | None) -> dict[str, Any]:
        metrics: dict[str, Any] = {"average_accuracy": 0.5, "bwt": -0.1}
        if kept is not None:
            metrics["budget"] = {"kept_every_task": kept, "tasks_kept": 1, "end_value": 1.0}
        folder = str(tmp_path / variant / f"s{seed}")
        return {"variant": variant, "folder": folder, "seed": seed, "tasks": ["a"],
                "metrics": metrics, "train_seconds": 1.0, "steps": 4}  # fmt: skip

    runs = [run("seq_ft", 0, None), run("ewc", 0, True), run("ewc", 1, False)]
    variants = [
        {"name": "seq_ft", "method": {"name": "seq_ft"}},
        {"name": "ewc", "method": {"name": "ewc"}},
    ]
    bench = {"seeds": 2, "orders": 1, "runs": runs, "variants": variants}
    _, sections, _ = sections_for_bench(bench, tmp_path)
    table = sections[0]
    assert table.headers[-1] == "budget kept (runs)"
    assert [row[-1] for row in table.rows] == ["n/a", "1 of 2"]


def test_a_parallel_benchs_pace_gives_the_time_left() -> None:
    assert pace_text(3, 15, 3600.0) == "3 of 15 runs; about 4h00m left at the pace so far"
    assert pace_text(1, 2, 90.0) == "1 of 2 runs; about 1m30s left at the pace so far"
    assert pace_text(2, 2, 500.0) == "2 of 2 runs"


@pytest.mark.parametrize(
    ("name", "content"),
    [("report.md", b"my own notes\n"), ("plots/forgetting.png", b"mine"), ("report.html", b"x")],
)
def test_a_report_replaces_its_own_files_and_none_of_the_users(
    name: str, content: bytes, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = validate_config(tiny_run_config(tiny_model_dir))
    Runner(cfg, tmp_path / "r", Console(quiet=True), progress=False).run()
    write_report(tmp_path / "r")
    write_report(tmp_path / "r")  # an earlier report is replaced
    mine = tmp_path / "r" / name
    mine.write_bytes(content)
    before = {p: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="is not part of a forgetless report"):
        write_report(tmp_path / "r")
    assert {p: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()} == before
