"""Slow tier: bench workers (spawned processes take seconds each to start)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console

from forgetless.bench import sweep
from forgetless.bench.cluster import ClusterJobError
from forgetless.bench.variants import ClusterSection, parse_variant
from forgetless.errors import ModelLoadError


def test_jobs_stop_on_a_failing_run(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    base = tiny_run_config(tmp_path / "no-such-model", tasks=["reverse"])
    variants = [parse_variant("seq_ft")]
    with pytest.raises(ModelLoadError, match="no-such-model"):
        sweep.run_bench(base, variants, 2, 1, tmp_path / "x", Console(quiet=True), False, jobs=2)
    named = re.search(r"failed; its log: (\S+)", capfd.readouterr().err)  # whichever ended first
    assert named and Path(named[1]).parent == tmp_path / "x" / "worker-logs"
    assert "ModelLoadError" in Path(named[1]).read_text(encoding="utf-8")  # with its traceback


def test_cluster_jobs_give_the_sequential_table(tiny_model_dir: Path, tmp_path: Path) -> None:
    """submitit's local executor runs the same jobs a Slurm cluster would; the bench reads each
    run's results.json and aggregates in the plan's order."""
    base = tiny_run_config(tiny_model_dir, tasks=["reverse"], train={"steps": 3, "batch_size": 4})
    variants = [parse_variant("seq_ft"), parse_variant("low_lr")]
    quiet = Console(quiet=True)
    torch.set_num_threads(1)
    one = sweep.run_bench(base, variants, 1, 1, tmp_path / "seq", quiet, False)
    spec = ClusterSection(cpus_per_task=1, poll_seconds=0.5)
    jobs = sweep.run_bench(
        base, variants, 1, 1, tmp_path / "job", quiet, False, cluster=("local", spec)
    )
    assert [r["variant"] for r in jobs["runs"]] == [r["variant"] for r in one["runs"]]
    for mine, theirs in zip(one["runs"], jobs["runs"], strict=True):
        assert mine["metrics"] == theirs["metrics"]
    assert any((tmp_path / "job" / "cluster-logs").iterdir())  # submitit's job logs


def test_a_failed_cluster_job_names_its_log(tmp_path: Path) -> None:
    base = tiny_run_config(tmp_path / "no-such-model", tasks=["reverse"])
    spec = ClusterSection(cpus_per_task=1, poll_seconds=0.5)
    with pytest.raises(ClusterJobError, match=r"ended without a finished run; its log: .*\.err"):
        sweep.run_bench(
            base, [parse_variant("seq_ft")], 1, 1, tmp_path / "x", Console(quiet=True), False,
            cluster=("local", spec),
        )  # fmt: skip
