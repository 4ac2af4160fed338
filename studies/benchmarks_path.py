"""Puts benchmarks/ on ``sys.path``, so that a study reuses the benchmarks' helpers by module
name, as the benchmarks themselves do: ``run_all``'s ``commit`` and ``machine`` (the provenance
every report carries), ``peak_memory`` and ``method_harness``. Imported for that effect alone,
before those names."""

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)
