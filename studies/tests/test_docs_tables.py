"""Every bench table quoted in the README and docs is what its committed raw results render."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import render_tables  # studies/ is on sys.path (conftest.py)
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", render_tables.DOCS, ids=lambda p: p.name)
def test_quoted_tables_match_their_data(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    assert render_tables.rewrite(text) == text, f"run python studies/render_tables.py ({doc})"


FIGURE = re.compile(
    r"(?<![\w.])(?<!≤ )(?<!≥ )[−+-]?[01]\.\d{1,3}(?![\d.])(?!\s*(?:×|s\b|[kMG]i?B|[MB]\b))"
)
"""An accuracy-like figure (0.88, −0.875, 1.00); not a ratio (1.15×), a time or a size."""
PROSE_ONLY = {
    "claims.md": None,
    "README.md": None,
    "findings.md": ("## A real pretrained LM", "## Benchmarks"),
}
"""Where every accuracy, BWT, retention or KL figure must come from a rendered block."""


def prose_of(text: str) -> str:
    """The text a person typed: rendered blocks, code and link targets taken out."""
    text = re.sub(r"(?s)<!-- ([\w-]+): [^>]*-->.*?<!-- /\1 -->", "", text)
    text = re.sub(r"(?s)```.*?```", "", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


@pytest.mark.parametrize("name", sorted(PROSE_ONLY))
def test_results_figures_come_from_rendered_blocks(name: str) -> None:
    doc = next(d for d in render_tables.DOCS if d.name == name)
    text = doc.read_text(encoding="utf-8")
    if (span := PROSE_ONLY[name]) is not None:
        text = text[text.index(span[0]) : text.index(span[1])]
    typed = [line for line in prose_of(text).splitlines() if FIGURE.search(line)]
    assert not typed, f"{doc}: figures typed by hand, not rendered from raw data: {typed}"


def test_the_figure_pattern_tells_scores_from_costs() -> None:
    found = [FIGURE.search(s) is not None for s in ("0.881 kept", "BWT −0.81", "1.115× a step")]
    assert FIGURE.search("a 1.0M-parameter model") is None
    assert found == [True, True, False]
    assert FIGURE.search("≤ 1.2 target") is None and FIGURE.search("took 1.55 s") is None
    assert prose_of("a `0.5` and <!-- t: x -->0.9<!-- /t --> b") == "a  and  b"


def test_the_renderer_pairs_by_seed() -> None:
    def run(variant: str, seed: int, retention: float) -> dict[str, object]:
        probe = {"base": 0.5, "now": 0.5 * retention, "chance": 0.0}
        metrics = {"probe_retention": {"p": probe}, "gain": 0.9, "average_accuracy": 0.5}
        return {"variant": variant, "seed": seed, "metrics": metrics | {"bwt": -0.5}}

    bench = {
        "variants": [{"name": "seq_ft"}, {"name": "kl"}],
        "runs": [run("seq_ft", s, r) for s, r in ((0, 0.2), (1, 0.6))]
        + [run("kl", s, r) for s, r in ((0, 0.4), (1, 0.8))],
    }
    table = render_tables.render(bench)
    kl = next(line for line in table.splitlines() if line.startswith("| kl "))
    assert kl.endswith("| 0.200 ± 0.000 | 0.000 ± 0.000 |")  # +0.2 in both seeds: no spread


def test_claim_rows_take_their_verdict_from_the_paired_interval() -> None:
    from claims_table import claim_row, load_claims

    def run(value: float) -> dict[str, object]:
        return {"metrics": {"retention": value}}

    claim = {"arm": "kl", "control": "seq_ft", "metric": "retention", "expected": 1}
    runs = {("seq_ft", s): run(v) for s, v in enumerate((0.2, 0.3, 0.4))}
    runs.update({("kl", s): run(v) for s, v in enumerate((0.4, 0.52, 0.6))})
    measured, verdict = claim_row(claim, runs, render_tables._metric)
    assert verdict == "supported" and "paired 0.207 ± 0.029 (3 seeds)" in measured
    assert claim_row({**claim, "expected": -1}, runs, render_tables._metric)[1] == "refuted"
    floor = {k: run(0.0) for k in runs}
    assert claim_row(claim, floor, render_tables._metric)[1] == "not testable here"
    one = {k: v for k, v in runs.items() if k[1] == 0}
    assert claim_row(claim, one, render_tables._metric)[1] == "exploratory"
    sections = {c["section"] for c in load_claims()}
    assert {"baselines-tiny", "baselines-real"} <= sections


def test_claim_texts_do_not_break_their_table() -> None:
    from claims_table import load_claims

    for claim in load_claims():
        assert "|" not in claim["claim"] + claim["source"], claim["claim"]


def test_the_scales_table_quotes_the_rows_it_points_at() -> None:
    from claims_scales import scale_cell

    table = (
        "| claim | method | measured | verdict |\n|---|---|---|---|\n"
        "| A predicts B | `x` | rho: 0.4 ± 0.2 (9 runs); without 0.5 | **refuted** |\n"
        "| A predicts B | `y` | BWT: y 0.1 vs 0.0; paired 0.1 ± 0.05 (5 seeds) | **supported** |\n"
        "| C | `y` | gain: `y` n/a vs `z` n/a; paired n/a (0 seeds) | **not measured** |\n"
    )

    def block(kind: str, key: str) -> str:
        assert (kind, key) == ("claims-table", "s")
        return table

    def cell(*lead: str) -> str:
        return scale_cell({"block": "claims-table", "key": "s", "row": list(lead)}, block, "here")

    assert cell("A predicts B", "`y`") == "**supported**: BWT, paired 0.1 ± 0.05 (5 seeds)"
    assert cell("A predicts B") == "**refuted**: rho, 0.4 ± 0.2 (9 runs)"
    assert cell("C") == "**not measured**"
    assert scale_cell({"missing": "why"}, block, "here") == "not measured: why"
    with pytest.raises(ValueError, match=r"here: no row starting \['D'\]"):
        cell("D")
    marked = {"block": "claims-table", "key": "s", "row": ["A predicts B"], "exploratory": True}
    assert scale_cell(marked, block, "here") == "**refuted** (exploratory): rho, 0.4 ± 0.2 (9 runs)"


def test_a_scales_cell_quotes_the_declared_familys_holm_verdict() -> None:
    from claims_scales import scale_cell

    family = (
        "| comparison | order A (persona last) | order B (persona first) | verdict |\n"
        "|---|---|---|---|\n"
        "| x vs y | +0.099 [+0.073, +0.128] (raw +0.033); p 0.000, Holm 0.002; "
        "gain +0.004 matched; n 5 | – | frontier |\n"
        "| z vs y | +0.020 [-0.010, +0.050] (raw +0.010); p 0.030, Holm 0.090; "
        "gain -0.010 matched; n 5 | -0.150 [-0.200, -0.100] (raw -0.050); p 0.001, "
        "Holm 0.004; gain +0.000 matched; n 5 | no difference shown |\n"
    )

    def block(kind: str, key: str) -> str:
        assert (kind, key) == ("verdicts-family", "plan.yaml")
        return family

    def cell(row: str) -> str:
        pointer = {"block": "verdicts-family", "key": "plan.yaml", "row": [row]}
        return scale_cell(pointer, block, "here")

    assert cell("x vs y") == (
        "**frontier** (declared, Holm): general retention (unclipped), "
        "order A +0.099 [+0.073, +0.128], Holm 0.002, gain +0.004 (5 seeds)"
    )
    assert cell("z vs y").endswith(
        "order A +0.020 [-0.010, +0.050], Holm 0.090, gain -0.010 (5 seeds); "
        "order B -0.150 [-0.200, -0.100], Holm 0.004, gain +0.000 (5 seeds)"
    )
    assert cell("z vs y").startswith("**no difference shown** (declared, Holm)")


def test_the_memory_model_follows_the_zero_accounting() -> None:
    from memory_model import METHODS, per_device_gb

    seq_ft, kl = METHODS["seq_ft"], METHODS["kl_sft"]
    assert per_device_gb(7e9, seq_ft, False, "DDP", 8) == pytest.approx(112.0)  # 16 B a weight
    assert per_device_gb(7e9, seq_ft, False, "FSDP / ZeRO-3", 8) == pytest.approx(14.0)
    assert per_device_gb(7e9, seq_ft, False, "ZeRO-2", 8) == pytest.approx(14 + 98 / 8)
    assert per_device_gb(7e9, kl, False, "DDP", 8) == pytest.approx(126.0)  # + a bf16 reference
    lora = per_device_gb(7e9, seq_ft, True, "DDP", 8)
    assert lora == pytest.approx((7e9 * 0.995 * 2 + 7e9 * 0.005 * 16) / 1e9)


def test_the_results_page_quotes_the_benchmarks_own_tables() -> None:
    targets = render_tables.results_section(1)
    assert targets.startswith("| what | measured | target | met |")
    page = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
    assert targets in page  # the costs are RESULTS.md's, never retyped
    with pytest.raises(ValueError, match="no section 99"):
        render_tables.results_section(99)


def test_budget_claims_follow_their_rules(tmp_path: Path) -> None:
    from budget_claims import render_budget

    spec = tmp_path / "arms.yaml"
    arms = {"budget": "b", "max_loss": 0.1, "plain": "p", "grid": ["g1", "g2", "g3", "g4"]}
    spec.write_text(yaml.safe_dump({"configs": {"c.yaml": [arms]}}), encoding="utf-8")

    def run(
        gain: float,
        retention: float,
        seconds: float,
        kept: bool | None = None,
        middle: float | None = None,
        checks: float = 1.0,
    ) -> dict:
        metrics: dict[str, object] = {"gain": gain, "retention": retention}
        if kept is not None:
            metrics["budget"] = {"kept_every_task": kept, "check_seconds": checks}
        middle = retention if middle is None else middle
        results = {  # the probe scores at the base and after each task (chance 0)
            "rows": ["base", "after t1", "after t2"],
            "probe_accuracy": [[1.0, 1.0], [middle, middle], [retention, retention]],
            "probe_chance": [0.0, 0.0],
            "eval_seconds": [1.0, 1.0, 1.0],
        }
        return {"metrics": metrics, "train_seconds": seconds, "results": results}

    seeds = [0, 1, 2]
    runs = {}
    for s in seeds:
        runs[("b", s)] = run(0.80 + 0.01 * s, 0.95, 11.0, kept=True)
        runs[("p", s)] = run(0.9, 0.5, 10.0)
        runs[("g1", s)] = run(0.60, 0.95, 10.0)  # keeps it, learns less
        runs[("g2", s)] = run(0.79 + 0.01 * s, 0.92, 10.0)  # keeps it: the oracle
        runs[("g3", s)] = run(0.95, 0.70, 10.0)  # learns more, over budget
        runs[("g4", s)] = run(0.97, 0.95, 10.0, middle=0.7)  # over it after the first task
    row = render_budget(runs, seeds, "c.yaml", spec).splitlines()[2]
    assert "100% kept; **supported**" in row
    assert "vs `g2`: +0.010 ± 0.000; **non-inferior**" in row
    # the checks' 1 s over the other 13 s; beside the plain run (11 + 3) / (10 + 3)
    assert "1.08× by its checks (beside `p`: 1.08×, training alone 1.10×); **met**" in row
    for s in seeds:  # the arm learns 0.1 less than the oracle: inferior
        runs[("b", s)] = run(0.69 + 0.01 * s, 0.95 if s else 0.85, 12.0, s != 0, checks=3.0)
    row = render_budget(runs, seeds, "c.yaml", spec).splitlines()[2]
    assert "67% kept; **not supported**" in row and "**inferior**" in row and "**not met**" in row
    # an arm naming a side-by-side measure is judged by it, its in-run figure kept beside
    spec.write_text(yaml.safe_dump({"configs": {"c.yaml": [arms | {"overhead": "m"}]}}))

    def pair(ratio: float, checks: float) -> dict:  # the budgeted run: 10 s of it not checks
        return {"ratio": ratio, "budget": {"check_seconds": checks, "wall_seconds": 10 + checks}}

    pairs = [pair(1.3, 1.0), pair(1.25, 1.4), pair(1.2, 1.6)]
    measured = {"m": {"median_ratio": 1.25, "ratio_range": [1.2, 1.3], "pairs": pairs}}
    side = tmp_path / "side.json"
    side.write_text(json.dumps({"methods": measured}), encoding="utf-8")
    row = render_budget(runs, seeds, "c.yaml", spec, side).splitlines()[2]
    # the median of the runs' own check shares (0.14) judges, not the noisier paired ratio
    assert "1.14× by its checks at the defaults (3 runs; CPU time beside its plain run" in row
    assert "run 1.25×, 1.20–1.30); 1.25× in the campaign's runs; **met** |" in row
    assert row.endswith("; **met** |")


def test_geometry_claims_compare_signals_run_by_run() -> None:
    import geometry_claims

    def level(values: dict[str, float]) -> dict[str, dict[str, float]]:
        return {"per_run": values}

    data = {
        "run_level_position_controlled": {
            "state_conflict": level({"a": -0.8, "b": -0.7, "c": -0.9}),
            "update_norm": level({"a": -0.1, "b": 0.2, "c": 0.0}),
            "pairwise_conflict": level({"a": -0.8, "b": -0.6, "c": -0.95}),
            "sar": level({"a": 0.1}),
        },
        "run_level": {"update_norm": level({"a": -0.9, "b": -0.95, "c": -0.85})},
    }
    rows = {r.split(" | ")[0][2:]: r for r in geometry_claims.claim_rows("seq_ft", data)}
    assert rows["State conflict predicts the loss of still-retained tasks"].endswith(
        "**supported** |"
    )
    assert (
        "without the control −0.900"
        in rows["Update norm predicts the loss of still-retained tasks"]
    )
    assert rows["Update norm predicts the loss of still-retained tasks"].endswith(
        "**inconclusive** |"
    )
    assert rows["State conflict predicts it better than update norm"].endswith("**supported** |")
    assert rows["State conflict predicts it better than pairwise conflict"].endswith(
        "**inconclusive** |"
    )
    assert rows["State conflict predicts it better than SAR"].endswith("**exploratory** |")


def test_geometry_inside_runs_takes_its_verdict_from_the_interval() -> None:
    from geometry_claims import within_rows

    def found(r: float, low: float, high: float, runs: int = 7) -> dict[str, object]:
        return {"r": r, "ci95": [low, high], "points": 3 * runs, "runs": runs}

    signals = {
        "state_conflict": found(-0.5, -0.8, -0.2),  # predicts: a larger conflict, a larger loss
        "update_norm": found(0.5, 0.2, 0.8),  # the other way: refuted
        "pairwise_conflict": found(-0.1, -0.5, 0.3),
        "sar": found(-0.6, -0.9, -0.1, runs=2),
    }
    data = {
        "runs": ["ewc/s0", "sae_fd/s1"],
        "within_run": {
            "signals": signals,
            "state_conflict_minus": {
                other: {"diff": 0.1, "ci95": [0.05, 0.2], "runs": 7}
                for other in ("update_norm", "pairwise_conflict", "sar")
            },
        },
    }
    rows = within_rows(data)
    verdicts = [row.rsplit("**", 2)[-2] for row in rows]
    assert verdicts[:4] == ["supported", "refuted", "inconclusive", "exploratory"]
    assert verdicts[4:] == ["supported"] * 3
    assert "every kept run (`ewc`, `sae_fd`)" in rows[0]
    assert "−0.500, 95% interval [−0.800, −0.200] (21 points, 7 runs)" in rows[0]


def test_circuits_claims_control_retention_by_circuit_size() -> None:
    import circuits_claims

    def row(size: int, retention: float, dcm: float, faith: float = 1.0) -> dict[str, object]:
        circuit = [[1] * 4] * (size // 4) + [[0] * 4] * (4 - size // 4)
        return {
            "circuit_size": size,
            "retention": retention,
            "dcm": dcm,
            "circuit": circuit,
            "faithfulness": faith,
        }

    def seed(rl_size: int, rl_ret: float, sft_ret: float) -> dict[str, dict[str, object]]:
        behaviour = {"rl": row(rl_size, rl_ret, 5.0), "sft": row(8, sft_ret, 4.0)}
        return {"facts": behaviour, "upper": behaviour, "reverse": behaviour}

    # RL keeps more of the base circuit only because its circuit is larger: 16 heads of 16.
    seeds = [seed(16, 1.0, 0.8), seed(16, 1.0, 0.85), seed(16, 1.0, 0.9)]
    assert circuits_claims.above_chance(seeds[0]["facts"]["rl"]) == 0.0
    rows = circuits_claims.behaviour_rows(seeds, "facts")
    assert rows[0].endswith("**supported** |")  # raw retention
    assert rows[1].endswith("**refuted** |")  # beyond a size-matched random circuit
    assert "paired 1.000 ± 0.000" in rows[2] and rows[2].endswith("**supported** |")
    # a circuit that does not reproduce the behaviour is not compared
    for s in seeds:
        s["reverse"] = {"rl": row(12, 1.0, 5.0), "sft": row(4, 0.5, 4.0, faith=0.1)}
    task_row = circuits_claims.render_circuits_rows(seeds)[-1]
    assert "faithfulness RL 1.000 ± 0.000, SFT 0.100 ± 0.000" in task_row
    assert task_row.endswith("**not testable here** |")
    assert "task circuit size (heads): RL 12.0 ± 0.0 vs SFT 4.0 ± 0.0" in task_row
    # one seed's ill-conditioned ratio cannot carry an unfaithful arm past the gate
    seeds[0]["reverse"]["sft"]["faithfulness"] = 9.4
    task_row = circuits_claims.render_circuits_rows(seeds)[-1]
    assert "SFT 0.400 ± 1.291" in task_row and task_row.endswith("**not testable here** |")


def test_circuits_claims_render_the_behaviours_and_task_their_file_names(tmp_path: Path) -> None:
    import circuits_claims

    one = {"circuit_size": 4, "retention": 0.5, "dcm": 1.0, "circuit": [[1, 0]], "faithfulness": 1}
    arms = {"rl": one, "sft": one}
    kept = {"seeds": {"0": {"gk-short": arms, "it-topic": arms}}, "behaviours": ["gk-short"],
            "task": "it-topic"}  # fmt: skip
    (tmp_path / "circuits.json").write_text(json.dumps(kept), encoding="utf-8")
    table = circuits_claims.render_circuits(tmp_path)
    assert "`gk-short` circuit" in table and "the `it-topic` task" in table
    assert "facts" not in table and "(1 seed)" in table
    assert circuits_claims.REAL.base == "smollm2-135m-instruct"
    assert circuits_claims.TINY.out.parent.name == "claims-circuits"


def test_circuits_claims_wait_for_both_runs_to_finish(tmp_path: Path) -> None:
    import circuits_claims

    for arm, seed, status in [("sft", 0, "complete"), ("rl-base", 0, "complete"),
                              ("sft", 1, "complete"), ("rl-base", 1, "running")]:  # fmt: skip
        (tmp_path / arm / f"s{seed}").mkdir(parents=True)
        (tmp_path / arm / f"s{seed}" / "results.json").write_text(json.dumps({"status": status}))
    assert circuits_claims.finished_seeds(tmp_path) == [0]


def test_circuits_claims_seeds_kept_apart_both_survive(tmp_path: Path) -> None:
    import circuits_claims

    out = tmp_path / "circuits.json"
    out.write_text(json.dumps({"seeds": {"0": {"x": 0}}}), encoding="utf-8")
    circuits_claims.keep(out, 2, {"x": 2}, circuits_claims.REAL)
    assert circuits_claims.keep(out, 1, {"x": 1}, circuits_claims.REAL) == 3
    kept = json.loads(out.read_text(encoding="utf-8"))
    assert kept["seeds"] == {"0": {"x": 0}, "1": {"x": 1}, "2": {"x": 2}}
    assert kept["task"] == "it-topic" and kept["effects"] == "attribution"


def test_gcwm_gates_are_grouped_by_layer_and_seed() -> None:
    import gcwm_gates

    def run(gate0: float, gate1: float) -> dict[str, object]:
        layers = {
            "model.layers.0.mlp.up_proj.weight": {"gate": gate0, "conflict": 1 - gate0},
            "model.layers.0.mlp.down_proj.weight": {"gate": gate0, "conflict": 1 - gate0},
            "model.layers.1.mlp.up_proj.weight": {"gate": gate1, "conflict": 1 - gate1},
        }
        return {"results": {"per_task": [{"details": {}}, {"details": {"gcwm_per_layer": layers}}]}}

    runs = {("gcwm", 0): run(0.9, 0.5), ("gcwm", 1): run(0.9, 0.7), ("ta", 0): {"results": {}}}
    table = gcwm_gates.render_gates(["ta", "gcwm"], runs)
    assert "| `gcwm` | 2 | 0.900 ± 0.000 | 0.600 ± 1.271 | 0.500–0.900 |" in table
    assert "`ta`" not in table


def test_a_retention_comparison_says_whether_its_gain_is_matched() -> None:
    """By TOST at 0.05: the 90% interval of the paired gain inside the margin (issue 49)."""
    assert render_tables._gain_clause([]) == ""
    near = render_tables._gain_clause([-0.01, -0.02, -0.015])
    assert near.endswith(": matched (TOST within 0.05)") and "−0.015" in near
    wide = render_tables._gain_clause([0.479, -0.083, -0.354])  # mean 0.014, seeds far apart
    assert wide.endswith("not matched (TOST: its 90% interval reaches past 0.05)")
    # issue 49's case: anchored against its restarts, −0.038 ± 0.054, read as matched before
    assert "not matched" in render_tables.gain_match([-0.062, -0.038, -0.014])
    assert render_tables.gain_match([0.01]) == "not testable on one seed"
    far = render_tables._gain_clause([-0.20, -0.15, -0.17])
    assert "not matched (TOST: its mean beyond 0.05)" in far


def test_a_campaign_table_can_show_some_of_its_variants() -> None:
    only = ["seq_ft", "replay@ratio=0.25"]
    text = render_tables.render_campaign("real-verdicts-sweep.yaml", only)
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| seq_ft", "| replay@ratio=0.25"]
    assert "ewc" not in text and "All 2 runs are kept" in text
    with pytest.raises(SystemExit, match=r"no variant replay@ratio=0\.3"):
        render_tables.render_campaign("real-verdicts-sweep.yaml", ["seq_ft", "replay@ratio=0.3"])


def test_no_claim_reads_a_clipped_retention() -> None:
    """A retention clipped at 1 ties every model that answers more than the base (issue 49)."""
    clipped = [c["claim"] for c in render_tables.load_claims() if c["metric"].startswith("probe:")]
    assert not clipped, f"claims on a clipped retention (use kept:NAME): {clipped}"


def test_unclipped_retention_goes_past_one() -> None:
    results = {"probes": ["mc"], "probe_chance": [0.25], "probe_accuracy": [[0.5], [0.6]]}
    assert render_tables.probe_change(results, "mc", above_chance=True) == pytest.approx(1.4)
    assert render_tables.probe_change(results, "mc", above_chance=False) == pytest.approx(0.1)
    at_chance = {**results, "probe_accuracy": [[0.25], [0.6]]}
    assert render_tables.probe_change(at_chance, "mc", above_chance=True) is None


def test_a_time_ratio_needs_one_cpu_and_the_cores_alone() -> None:
    def run(seconds: float, cpu: str = "AMD EPYC", alone: bool = True) -> dict[str, object]:
        return {"train_seconds": seconds, "sitting": {"cpu": cpu, "alone": alone}}

    assert render_tables._time_ratio([run(150.0)], [run(100.0), run(100.0)]) == "1.50"
    assert render_tables._time_ratio([run(150.0, cpu="Intel Xeon")], [run(100.0)]) == "–"
    assert render_tables._time_ratio([run(150.0)], [run(100.0, alone=False)]) == "–"
    assert render_tables._time_ratio([run(150.0)], []) == "–"


def test_the_plan_at_three_scales_orders_its_settings() -> None:
    """Per model and method: checkpointing lowers the LoRA peak, a 4-bit base lowers it again,
    and a method that needs the base's full weights is refused under QLoRA, not planned."""
    from memory_plan_scales import render_plan_scales

    rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in render_plan_scales("memory_plan_scales.yaml").splitlines()[2:]
    ]
    assert {r[0] for r in rows} == {"Llama-3.2-1B", "Qwen2.5-7B", "Llama-3.1-70B"}
    for _, method, lora, ckpt, qlora, _full in rows:
        assert float(ckpt) < float(lora), method
        assert qlora == "refused" or float(qlora) < float(ckpt), method
    refused = {r[1] for r in rows if r[4] == "refused"}
    assert "`anchored`" in refused and "`seq_ft`" not in refused
