"""The first real-track campaign's reading of each declared comparison beside the declared
campaign's verdict: which verdicts changed, and the design difference behind each change
(issue 49 asks for the count and the why).

The first campaign (``studies/configs/real.yaml``, 3 seeds, strengths set before its runs) read a
comparison from one paired 95% t-interval of the ``gk-mc`` retention (unclipped), with no
correction for its sixteen comparisons and no gain matching. Its "inconclusive" is the declared
campaign's "no difference shown".
"""

from __future__ import annotations

from render_tables import PRIMARY as FIRST_METRIC
from render_tables import paired_by_seed
from verdict_judge import Judged

from forgetless.bench.stats import paired_verdict

FIRST = "real.yaml"
SAID = {
    "supported": "retains more",
    "refuted": "retains less",
    "inconclusive": "no difference shown",
}


def first_label(judged: Judged) -> str | None:
    """The first campaign's label for ``judged``'s comparison; None where it ran no such pair."""
    diffs = paired_by_seed(FIRST, judged.arm, judged.control, FIRST_METRIC)
    if not diffs:
        return None
    verdict = paired_verdict(diffs, judged.expected)
    return SAID.get(verdict, verdict)


def why(first: str, now: Judged) -> str:
    """The design difference that moved a verdict (empty when it did not move)."""
    stat, verdict = now.orders.get("a", {}), now.verdict
    if verdict == first:
        return ""
    if verdict == "frontier" and first == "retains more":
        return "its gain is not TOST-matched to the control's, so it is judged on the frontier"
    if verdict == "frontier":
        return "five seeds show a difference, at a gain not TOST-matched: judged on the frontier"
    if verdict == "no difference shown" and stat.get("p", 1.0) < 0.05:
        return "significant unadjusted, not after Holm across the family"
    if verdict == "no difference shown":
        return "five seeds on general retention (and items resampled) do not show it"
    if "in order A only" in verdict and first == "no difference shown":
        return (
            "five seeds on general retention show it with the persona task last, which three on "
            "gk-mc did not; order B, with the persona task first, does not repeat it"
        )
    if "in order A only" in verdict:
        return "order B, with the persona task first, does not repeat it"
    return "five seeds on general retention show what three on gk-mc did not"


def then_and_now_lines(family: list[Judged], strengths: dict[str, tuple[str, str]]) -> list[str]:
    """The page's section: one row per declared comparison, then the count of changes once
    every row is final. ``strengths``: arm → (its strength in the first campaign, now)."""
    lines = [
        "## Then and now",
        "",
        "The first real-track campaign (`studies/configs/real.yaml`: 3 seeds, at the strengths "
        "in the third column, one paired t-interval of the `gk-mc` retention per comparison, no "
        "Holm, no gain matching) beside the declared campaign's verdict.",
        "",
        "| comparison | first campaign | strength then → now | declared campaign | why it moved |",
        "|---|---|---|---|---|",
    ]
    final, changed = 0, 0
    firsts = [first_label(judged) for judged in family]  # each reads the first campaign's runs
    for judged, first in zip(family, firsts, strict=True):
        pending = judged.verdict.startswith(("pending", "not run"))
        reason = "–" if pending or first is None else why(first, judged)
        lines.append(
            f"| {judged.arm} vs {judged.control} | {first or 'not run then'} "
            f"| {_strengths(judged, strengths)} | {judged.verdict} | {reason} |"
        )
        if first is not None and not pending:
            final, changed = final + 1, changed + (judged.verdict != first)
    compared = sum(first is not None for first in firsts)
    if final < compared:
        count = f"The count of changed verdicts waits for every row: {final} of {compared} final."
    else:
        count = f"{changed} of {compared} verdicts changed."
    return [*lines, "", count, ""]


def _strengths(judged: Judged, strengths: dict[str, tuple[str, str]]) -> str:
    """The arm's strength then → now, and the control's where it is not the plain baseline."""
    then, now = strengths.get(judged.arm, ("–", "–"))
    cell = f"{then} → {now}"
    if judged.control in strengths and judged.control != "seq_ft":
        then, now = strengths[judged.control]
        cell += f"; {judged.control}: {then} → {now}"
    return cell
