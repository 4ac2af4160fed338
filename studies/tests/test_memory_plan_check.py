"""The memory plan's check table in docs/performance.md is rendered from the committed
``gpu_check.py`` reports, the error column from the plan's peak and the measured one."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import render_tables  # studies/ is on sys.path (conftest.py)
from memory_plan_check import render_folder, render_reports

PERFORMANCE = Path(render_tables.ROOT) / "docs" / "performance.md"


def report(measured: float) -> dict[str, Any]:
    plan = {"weights": 4.2, "gradients": 3.8, "optimizer": 7.6, "method_state": 8.1}
    plan |= {"activations": 100.6, "peak": 121.0, "method": "kl_sft"}
    row = {"method": "kl_sft", "mode": "lora", "peak_mb": measured, "plan_mb": plan}
    return {
        "settings": {"shape": "builtin", "batch_size": 32, "length": 64, "checkpointing": False},
        "provenance": {
            "commit": "0123456789abcdef",
            "src_dirty": True,
            "cpu": "Test CPU",
            "cores": 2,
            "torch_threads": 1,
            "load_average": {"before": 1.04, "after": 2.0},
        },
        "rows": [row, {"method": "trl_sft", "mode": "full", "peak_mb": 9.0}],
    }


def test_a_report_renders_its_row_with_the_error_of_plan_over_measured() -> None:
    table = render_reports({"builtin-off.json": report(measured=110.0)})
    row = "| built-in tiny shape (Llama) | B32 × T64 | off | `kl_sft` | lora | 4 | 11 | 8 | 101 |"
    assert f"{row} 121 | 110 | +10.0% |" in table.splitlines()
    assert "| 121 | 110 | -9.1% |" not in table  # measured over plan, the wrong way round
    assert "trl_sft" not in table  # TRL's case has no plan
    assert table.rstrip().endswith(
        "commit 0123456 with uncommitted changes to `src/`, on Test CPU (2 cores, 1 torch "
        "thread(s)); 1-minute load average 1.0–1.0 before a run, 2.0–2.0 after."
    )


def test_a_case_without_a_peak_names_its_report() -> None:
    broken = report(110.0)
    broken["rows"] = [{"case": ["method_case", "ewc", "full"], "error": "killed"}]
    with pytest.raises(ValueError, match=r"builtin-on\.json: case .*ewc.* killed"):
        render_reports({"builtin-on.json": broken})


def test_the_doc_block_is_the_render_of_the_committed_reports() -> None:
    text = PERFORMANCE.read_text(encoding="utf-8")
    found = render_tables.PLAN_CHECK.search(text)
    assert found is not None, "docs/performance.md lost its memory-plan-check block"
    assert found.group(3) == render_folder(found.group(2))


def test_a_wrong_error_cell_in_the_doc_is_stale() -> None:
    found = render_tables.PLAN_CHECK.search(PERFORMANCE.read_text(encoding="utf-8"))
    assert found is not None
    block = found.group(0)  # the block alone: rewrite renders it and no other
    tampered = re.sub(r"\| [+-]\d+\.\d% \|\n", "| +99.9% |\n", block, count=1)
    assert tampered != block
    assert render_tables.rewrite(tampered) == block
