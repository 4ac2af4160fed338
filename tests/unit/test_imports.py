"""Modules a command or a user imports first must import on their own (no circular imports)."""

from __future__ import annotations

import subprocess
import sys

ENTRY_MODULES = [
    "forgetless.core.storage",
    "forgetless.diagnostics.diagnose_geometry",
    "forgetless.sae.activations",
    "forgetless.bench.sweep",
    "forgetless.report.render",
    "forgetless.cli.app",
]


def test_entry_modules_import_in_a_fresh_interpreter() -> None:
    processes = {
        name: subprocess.Popen(
            [sys.executable, "-c", f"import {name}"], stderr=subprocess.PIPE, text=True
        )
        for name in ENTRY_MODULES
    }
    failures = {
        name: p.communicate(timeout=300)[1].strip().splitlines()[-1:]
        for name, p in processes.items()
        if p.wait(timeout=300) != 0
    }
    assert not failures, failures
