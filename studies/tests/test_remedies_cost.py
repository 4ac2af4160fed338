"""The remedies' cost tables render from their reports, and the step harness times each method
only in the fine-tuning modes its rules allow."""

from __future__ import annotations

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
import render_tables  # studies/ is on sys.path (conftest.py)
from method_harness import supports
from remedies_cost import render_steps, summarize

MACHINE = {"cpu": "AMD EPYC", "cores": 2, "torch_threads": 1, "torch": "2.x"}
LOAD = {"before": 6.2, "after": 7.9}


def test_the_harness_skips_a_mode_the_method_refuses() -> None:
    assert supports("block_expansion", "full") and not supports("block_expansion", "lora")
    assert supports("o_lora", "lora") and not supports("o_lora", "full")
    assert supports("dft", "full") and supports("dft", "lora")


def test_a_method_steps_report_renders_as_results_md_with_its_machine() -> None:
    def record(step: float, peak: float) -> list[dict[str, float]]:
        return [{"step_s": step, "task_s_per_step": step, "peak_mb": peak}]

    rows = [
        {"method": m, "mode": "full", "step_ratio": r, "task_ratio": r, "peak_ratio": 1.0}
        | {"state_bytes": 0}
        for m, r in (("seq_ft", 1.0), ("dft", 1.1))
    ]
    report = {
        "machine": MACHINE,
        "load_average": LOAD,
        "settings": {"repeats": 2, "steps": 30, "warmup": 5, "batch_size": 32},
        "rows": rows,
        "runs": {
            "seq_ft/full": [record(1.0, 400), record(1.0, 400)],
            "dft/full": [record(1.0, 400), record(1.2, 400)],
        },
    }
    table = render_tables.method_steps_table(report, "method_steps_x.json")
    dft = next(line for line in table.splitlines() if line.startswith("| `dft`"))
    assert dft.startswith("| `dft` | 1.10× ± 0.10 | 1.10× ± 0.10 | 1.00× ± 0.00 | n/a |")
    assert "AMD EPYC (2 cores, 1 torch thread(s)" in table and "6.2 before, 7.9 after" in table


def test_step_ratios_pair_each_repeat_with_seq_ft() -> None:
    runs = {
        "seq_ft": [{"times": [1.0, 1.0, 1.0], "peak_mb": 1}, {"times": [2.0], "peak_mb": 1}],
        "dft": [{"times": [1.5], "peak_mb": 1}, {"times": [2.0], "peak_mb": 1}],
    }
    rows = summarize(runs)
    assert rows["dft"]["ratio_range"] == [1.0, 1.5] and rows["dft"]["ratio"] == 1.25
    report = {
        "rows": rows,
        "settings": {"repeats": 2, "warmup": 1, "steps": 3},
        "machine": MACHINE,
        "load_average": LOAD,
    }
    assert "| `dft` | 1.75 (1.50–2.00) | 1.25× (1.00–1.50) |" in render_steps(report)
