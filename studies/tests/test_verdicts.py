"""The verdicts plan's tests: unclipped retention decides, only declared comparisons reach a
verdict line, Holm and TOST as declared, and the sweep's choice follows the plan's rule."""

from __future__ import annotations

import random
from typing import Any

import pytest
import verdict_judge
import verdict_then
import verdicts
from verdict_judge import Judged, frontier_lines, judge_family, verdict_line
from verdict_stats import ProbeRun, bootstrap_interval, general_retention, holm, tost_matched

PLAN = verdicts.load_plan()
ITEMS = 200


def outcomes(rate: float, rng: random.Random) -> str:
    return "".join("1" if rng.random() < rate else "0" for _ in range(ITEMS))


def record(seed: int, base: float, now: float, gain: float, rng: random.Random) -> dict[str, Any]:
    """A kept run: gk-mc with the given base and final rates, chat-format at ceiling."""
    items = [[outcomes(base, rng), "1" * 32], [outcomes(now, rng), "1" * 32]]
    score = [[r[0].count("1") / ITEMS, 1.0] for r in items]
    return {
        "summary": {"seed": seed, "metrics": {"gain": gain}},
        "results": {
            "probes": ["gk-mc", "chat-format"],
            "probe_chance": [0.25, 0.0],
            "probe_items": items,
            "probe_accuracy": score,
            "accuracy_matrix": [[0.0, 0.0], [gain, 0.0], [0.0, gain]],
        },
    }


def campaign(arms: dict[str, tuple[float, float]], gains: dict[str, float]) -> dict[str, Any]:
    rng = random.Random(0)
    return {
        f"cpu/{arm}/s{seed}": record(seed, base, now, gains.get(arm, 0.9), rng)
        for arm, (base, now) in arms.items()
        for seed in range(1000, 1005)
    }


def test_retention_above_the_base_is_not_clipped() -> None:
    """Both arms end above the base's score: clipped at 1 they would tie; unclipped, the arm
    that gained more is judged to keep more (the TIES and sae_fd-dense rows of issue 49)."""
    records = campaign({"replay": (0.55, 0.75), "seq_ft": (0.55, 0.60)}, {})
    replay = next(j for j in judge_family(PLAN, {"a": records}) if j.arm == "replay")
    stat = replay.orders["a"]
    assert stat["diff"] > 0.3 and stat["bootstrap"][0] > 0
    assert replay.verdict_a == "retains more"
    assert stat["dropped"] == ["chat-format"]  # at ceiling in every run: left out, and said
    assert "+0." in verdict_line(PLAN, replay)


def test_unmatched_gain_is_the_frontier_not_retains_more() -> None:
    records = campaign({"ewc": (0.55, 0.55), "seq_ft": (0.55, 0.35)}, {"ewc": 0.5})
    ewc = next(j for j in judge_family(PLAN, {"a": records}) if j.arm == "ewc")
    assert ewc.verdict_a == "frontier"


def test_only_declared_comparisons_and_metric_reach_a_verdict_line() -> None:
    with pytest.raises(ValueError, match="not in the declared family"):
        verdict_line(PLAN, Judged("ties", "seq_ft", 1, "x"))
    with pytest.raises(ValueError, match="primary metric"):
        verdict_line(PLAN, Judged("replay", "seq_ft", 1, "x", metric="retention_clipped"))


def test_holm_and_tost_against_hand_computed_values() -> None:
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert tost_matched([0.01, -0.02, 0.0, 0.015, -0.005], margin=0.05)
    assert not tost_matched([0.04, 0.08, 0.03, 0.07, 0.06], margin=0.05)


def test_bootstrap_interval_holds_the_point_estimate() -> None:
    rng = random.Random(1)
    arm = [[ProbeRun(0.25, outcomes(0.6, rng), outcomes(0.55, rng))] for _ in range(5)]
    control = [[ProbeRun(0.25, outcomes(0.6, rng), outcomes(0.4, rng))] for _ in range(5)]
    point = (
        sum(general_retention(a) - general_retention(c) for a, c in zip(arm, control, strict=True))
        / 5
    )
    low, high = bootstrap_interval(arm, control, resamples=2000)
    assert low < point < high and low > 0


def test_the_sweep_choice_follows_the_rule() -> None:
    sweep = {"seq_ft": [0.90], "dft@default": [0.70]}
    for arm, method in PLAN["arms"].items():
        for label, _ in verdicts.strengths(method):
            sweep.setdefault(f"{arm}@{label}", [0.88])
    sweep["kl_sft@beta=0.4"] = [0.60]  # the strongest loses gain: the next strongest is chosen
    chosen = verdicts.choose(PLAN, sweep)
    assert chosen["kl_sft"]["beta"] == 0.1 and chosen["ewc"]["lam"] == 120000.0
    assert chosen["dft"] == {"name": "dft"}


def test_the_sweep_config_matches_the_plan() -> None:
    cfg = verdicts.sweep_config(PLAN)
    assert cfg["eval"]["between"] == cfg["eval"]["n_eval"]
    assert cfg["bench"]["first_seed"] == PLAN["sweep"]["seeds"][0]
    assert set(PLAN["seeds"]["measuring"]).isdisjoint(PLAN["seeds"]["retired"])
    names = [t if isinstance(t, str) else t["builtin"] for t in cfg["tasks"]]
    assert names == PLAN["test_bed"]["tasks_order_a"]


def test_the_second_family_is_judged_with_its_own_holm() -> None:
    """General-data replay (issue 51) is declared apart: its two comparisons are judged, Holm
    counts its own two tests only, and the rendered page gives it its own table."""
    arms = {"replay-general": (0.55, 0.70), "replay": (0.55, 0.52), "seq_ft": (0.55, 0.40)}
    records = campaign(arms, {})
    second = judge_family(PLAN, {"a": records}, "second_family")
    assert [(j.arm, j.control) for j in second] == [
        ("replay-general", "seq_ft"),
        ("replay-general", "replay"),
    ]
    p = [j.orders["a"]["p"] for j in second]
    assert [j.orders["a"]["p_holm"] for j in second] == pytest.approx(holm(p))
    assert all(j.verdict_a == "retains more" for j in second)
    first = judge_family(PLAN, {"a": records})
    page = verdicts.render(PLAN, first, second)
    assert "Second family, general-data replay" in page
    assert page.count("| replay-general vs ") == 2
    assert verdict_line(PLAN, second[1]).startswith("| replay-general vs replay |")


def test_the_sweep_leaves_out_a_strength_the_method_refuses() -> None:
    """replay-general's task share ×4 (0.95, clipped) beside its general share 0.25 overfills
    the batch: that strength is left out, the other two run."""
    names = [v["name"] for v in verdicts.sweep_config(PLAN)["bench"]["variants"]]
    assert [n for n in names if n.startswith("replay-general@")] == [
        "replay-general@ratio=0.25",
        "replay-general@ratio=0.0625",
    ]
    assert "replay@ratio=0.95" in names


def test_a_verdict_waits_for_every_declared_seed() -> None:
    """A campaign that has landed three of its five seeds shows its interim cells but no
    verdict: seed-by-seed runs make partial pairs common."""
    records = campaign({"replay": (0.55, 0.75), "seq_ft": (0.55, 0.40)}, {})
    partial = {run: r for run, r in records.items() if not run.endswith(("s1003", "s1004"))}
    replay = next(j for j in judge_family(PLAN, {"a": partial}) if j.arm == "replay")
    assert replay.orders["a"]["n"] == 3
    assert replay.verdict_a == replay.verdict == "pending (3 of 5 seeds)"
    first = {run: r for run, r in records.items() if run.endswith("s1000")}
    one = next(j for j in judge_family(PLAN, {"a": first}) if j.arm == "replay")
    line = verdict_line(PLAN, one)  # one pair: no interval, no test, and no nan printed
    assert "nan" not in line and " p " not in line and line.endswith("| pending (1 of 5 seeds) |")


def test_the_sweep_table_marks_the_measured_strength_and_why() -> None:
    sweep = {"seq_ft": [0.90], "dft@default": [0.70]}
    for arm, method in PLAN["arms"].items():
        for label, _ in verdicts.strengths(method):
            sweep.setdefault(f"{arm}@{label}", [0.88])
    del sweep["asft@alpha=0.4"]  # still running
    rows = {
        tuple(c.strip() for c in line.split("|")[1:3]): line
        for line in verdicts.sweep_lines(PLAN, sweep)
        if line.startswith("| ")
    }
    assert rows[("kl_sft", "beta=0.4")].endswith("| within the margin |")
    assert rows[("kl_sft", "beta=0.1")].endswith("|  |")
    assert rows[("dft", "default")].endswith("| nearest: frontier only |")
    assert not any(
        line.endswith(("margin |", "only |")) for (arm, _), line in rows.items() if arm == "asft"
    )
    with pytest.raises(SystemExit, match="asft"):
        verdicts.choose(PLAN, sweep)


def test_the_verdicts_page_renders_from_the_kept_runs() -> None:
    """docs/verdicts.md is what `python studies/verdicts.py render` makes of the packs."""
    assert verdicts.main(["render", "--check"]) == 0


def test_the_page_prints_the_plans_errata_beside_the_declared_text() -> None:
    plan = verdicts.load_plan()
    plan["errata"] = ["the costs were wrong"]
    page = verdict_judge.render(plan, [])
    assert f"Not in the family: {plan['not_in_family']}" in page
    assert "Erratum, added after the runs: the costs were wrong" in page


def test_status_names_the_seeds_still_to_run() -> None:
    cfg = {
        "bench": {"seeds": 3, "first_seed": 1000, "variants": [{"name": "seq_ft"}, {"name": "ewc"}]}
    }
    landed = {"seq_ft/s1000", "seq_ft/s1001", "ewc/s1000", "ewc/s900"}
    assert verdicts.missing_seeds(cfg, landed) == {"seq_ft": [1002], "ewc": [1001, 1002]}


def test_measuring_runs_resume_inside_a_task() -> None:
    """Order A's runs span sittings: each writes step checkpoints; the sweep's did not, and its
    kept runs' configs stay as they ran."""
    arms = {"seq_ft": {"name": "seq_ft"}}
    assert verdicts.measuring_config(PLAN, "a", arms)["train"]["checkpoint_every"] == 25
    assert "checkpoint_every" not in verdicts.sweep_config(PLAN)["train"]


def test_the_frontier_table_marks_the_arms_no_other_beats_in_both() -> None:
    """ewc keeps more but learns less than seq_ft: both are on the front; replay, below seq_ft
    in retention at the same gain, is not."""
    arms = {"seq_ft": (0.55, 0.40), "ewc": (0.55, 0.55), "replay": (0.55, 0.30)}
    records = campaign(arms, {"seq_ft": 0.9, "ewc": 0.5, "replay": 0.9})
    lines = [line for line in frontier_lines(PLAN, records) if line.startswith("| ")]
    rows = {line.split("|")[1].strip(): line for line in lines}
    assert rows["seq_ft"].endswith("| yes |") and rows["ewc"].endswith("| yes |")
    assert rows["replay"].endswith("|  |") and "| 5 | 0.900 ± 0.000 |" in rows["replay"]


def test_order_b_waits_for_order_a_and_takes_the_arms_it_judged() -> None:
    """Order B runs the control and the arms order A judged to keep more or less; it refuses
    while an order-A row is pending, since the rule reads finished verdicts only."""
    chosen = [{"name": arm, "method": method} for arm, method in PLAN["arms"].items()]
    arms = {"seq_ft": (0.55, 0.40), "replay": (0.55, 0.70), "kl_sft": (0.55, 0.41)}
    records = campaign({**{arm: (0.55, 0.45) for arm in PLAN["arms"]}, **arms}, {})
    both = judge_family(PLAN, {"a": records}) + judge_family(PLAN, {"a": records}, "second_family")
    picked = verdicts.order_b_arms(PLAN, both, chosen)
    assert "seq_ft" in picked and "replay" in picked and "kl_sft" not in picked
    first = {key: run for key, run in records.items() if key.endswith("/s1000")}
    pending = judge_family(PLAN, {"a": first})
    with pytest.raises(SystemExit, match="order A has not finished replay vs seq_ft"):
        verdicts.order_b_arms(PLAN, pending, chosen)


def test_a_verdict_that_needs_order_b_waits_for_its_seeds() -> None:
    """ "Retains more" in order A is final only with order B's five seeds: until then the row is
    pending (and the then-and-now count waits), and it holds only where B agrees."""
    arms = {"replay": (0.55, 0.75), "seq_ft": (0.55, 0.60)}
    order_a = campaign(arms, {})
    order_b = {key: run for key, run in order_a.items() if key.endswith(("/s1000", "/s1001"))}

    def replay(orders: dict[str, Any]) -> Judged:
        return next(j for j in judge_family(PLAN, orders) if j.arm == "replay")

    assert replay({"a": order_a}).verdict == "pending (order B: 0 of 5 seeds)"
    assert replay({"a": order_a, "b": order_b}).verdict == "pending (order B: 2 of 5 seeds)"
    assert replay({"a": order_a, "b": order_a}).verdict == "retains more"
    lost = campaign({"replay": (0.55, 0.50), "seq_ft": (0.55, 0.60)}, {})
    assert replay({"a": order_a, "b": lost}).verdict.startswith("retains more in order A only")


def test_then_and_now_counts_the_verdicts_that_moved_and_says_why() -> None:
    """The first campaign's labels are read from its kept runs (as docs/findings.md prints
    them); a row counts once final, and a move names the design difference behind it."""
    assert verdict_then.first_label(Judged("replay", "seq_ft", 1, "x")) == "retains more"
    assert verdict_then.first_label(Judged("asft", "seq_ft", 1, "x")) is None
    now = {
        ("replay", "seq_ft"): ("retains more", 0.001),
        ("ewc", "seq_ft"): ("frontier", 0.001),
        ("kl_sft", "seq_ft"): ("no difference shown", 0.5),
        ("sae_fd", "seq_ft"): ("no difference shown", 0.01),
        ("sae_fd", "sae_fd-dense"): ("retains less", 0.001),
    }
    family = [
        Judged(arm, control, 1, "x", orders={"a": {"p": p}}, verdict=verdict)
        for (arm, control), (verdict, p) in now.items()
    ]
    lines = verdict_then.then_and_now_lines(
        family, {"sae_fd": ("a", "b"), "sae_fd-dense": ("c", "d")}
    )
    assert lines[-2] == "2 of 5 verdicts changed."
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert "not TOST-matched" in rows["ewc vs seq_ft"]
    assert "not after Holm" in rows["sae_fd vs seq_ft"]
    assert "a → b; sae_fd-dense: c → d" in rows["sae_fd vs sae_fd-dense"]
    assert rows["replay vs seq_ft"].endswith("| retains more |  |")
    only_a = "retains more in order A only (order B: no difference shown)"
    assert "which three on gk-mc did not; order B" in verdict_then.why(
        "no difference shown", Judged("kl_sft", "seq_ft", 1, "x", verdict=only_a)
    )
    assert verdict_then.why("retains more", Judged("sae_fd", "seq_ft", 1, "x", verdict=only_a)) == (
        "order B, with the persona task first, does not repeat it"
    )
    family[0].verdict = "pending (4 of 5 seeds)"
    assert "waits for every row: 4 of 5" in verdict_then.then_and_now_lines(family, {})[-2]


def test_status_estimates_the_hours_left_from_each_arms_median() -> None:
    """Two seeds to go of an arm whose runs took 1 and 3 hours (train + eval) beside one of an
    arm at 2 hours, on two workers: (2·2 + 2) / 2 = 3 hours; an arm with none landed yet makes
    the estimate unknown."""

    def run(hours: float) -> dict[str, Any]:
        return {
            "summary": {"train_seconds": hours * 3000},
            "results": {"eval_seconds": [0, hours * 600]},
        }

    records = {"cpu/a/s1": run(1), "cpu/a/s2": run(3), "cpu/a/s3": run(2), "cpu/b/s1": run(2)}
    stage = verdicts.Stage("order A", "x.yaml", 8, {"a": [4, 5], "b": [2]}, records)
    assert verdicts.hours_left(stage, jobs=2) == pytest.approx(3.0)
    stage = verdicts.Stage("order A", "x.yaml", 8, {"a": [4], "c": [1]}, records)
    assert verdicts.hours_left(stage, jobs=2) is None
