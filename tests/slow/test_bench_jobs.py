"""Slow tier: bench workers (spawned processes take seconds each to start)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_run_config
from rich.console import Console

from forgetless.bench import sweep
from forgetless.bench.variants import parse_variant
from forgetless.errors import ModelLoadError


def test_jobs_stop_on_a_failing_run(tmp_path: Path) -> None:
    base = tiny_run_config(tmp_path / "no-such-model", tasks=["reverse"])
    variants = [parse_variant("seq_ft")]
    with pytest.raises(ModelLoadError, match="no-such-model"):
        sweep.run_bench(base, variants, 2, 1, tmp_path / "x", Console(quiet=True), False, jobs=2)
