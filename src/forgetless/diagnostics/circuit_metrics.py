"""Metrics over head-level circuits: size, faithfulness, retention, mask shifts, specialists,
mediation, and differential circuit vulnerability.

All follow "Mechanistic origins of catastrophic forgetting: why RL preserves circuits better than
SFT?" (summary in shared/papers/000). Masks are ``(L, H)`` tensors (layers × heads): DBM's
relaxed mask values in [0, 1], circuits as their binarisation (bool). ``m`` is the behaviour
metric, the mean log-probability of the target answers (nats), so m(∅) ≤ m(C) ≤ m(M) in the usual
case and differences of ``m`` are log-probability ratios.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ShiftClass = Literal["preserved", "amplified", "weakened"]
Vulnerability = Literal["a_vulnerable", "b_vulnerable", "neutral"]


def circuit_size(circuit: torch.Tensor) -> int:
    """Number of heads in the circuit."""
    return int(circuit.bool().sum())


def circuit_fraction(circuit: torch.Tensor) -> float:
    """Share of all heads that are in the circuit (the paper reports 46.0% vs 51.4%)."""
    return circuit_size(circuit) / circuit.numel()


def faithfulness(m_circuit: float, m_empty: float, m_full: float) -> float | None:
    """(m(C) − m(∅)) / (m(M) − m(∅)): the share of the full model's behaviour, above the fully
    patched model's, that the circuit alone recovers (1 = all of it). Undefined (None) when the
    full model does no better than the patched one."""
    gap = m_full - m_empty
    if gap == 0:
        return None
    return (m_circuit - m_empty) / gap


def retention(base: torch.Tensor, tuned: torch.Tensor) -> float | None:
    """|C_base ∩ C_ft| / |C_base|: the share of the base circuit's heads still in the tuned
    model's circuit (the paper: SFT 59.0%, RL 72.5% after two epochs). None for an empty base."""
    base, tuned = base.bool(), tuned.bool()
    size = int(base.sum())
    if size == 0:
        return None
    return int((base & tuned).sum()) / size


@dataclass
class MaskShifts:
    delta: torch.Tensor  # (L, H): Δm_h = m_ft − m_base
    classes: list[list[ShiftClass]]  # per layer, per head
    counts: dict[str, int]


def mask_shifts(base: torch.Tensor, tuned: torch.Tensor, threshold: float = 0.1) -> MaskShifts:
    """Δm_h = m_h(tuned) − m_h(base) per head, classed amplified (Δ > threshold), weakened
    (Δ < −threshold) or preserved (|Δ| ≤ threshold)."""
    delta = (tuned.float() - base.float()).cpu()
    classes: list[list[ShiftClass]] = [
        [
            "amplified" if d > threshold else "weakened" if d < -threshold else "preserved"
            for d in row
        ]
        for row in delta.tolist()
    ]
    flat = [c for row in classes for c in row]
    counts = {c: flat.count(c) for c in ("preserved", "amplified", "weakened")}
    return MaskShifts(delta, classes, counts)


def normalized_effects(
    necessity: torch.Tensor, sufficiency: torch.Tensor, m_full: float, m_empty: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Necessity and sufficiency as shares of the whole effect m(M) − m(∅) (zeros if none)."""
    gap = m_full - m_empty
    if gap == 0:
        return torch.zeros_like(necessity), torch.zeros_like(sufficiency)
    return necessity / gap, sufficiency / gap


def critical_specialists(
    necessity: torch.Tensor,
    sufficiency: torch.Tensor,
    m_full: float,
    m_empty: float,
    threshold: float = 0.1,
) -> list[tuple[int, int]]:
    """Heads high in both necessity and sufficiency: patching the head alone costs, and the head
    alone recovers, at least ``threshold`` of m(M) − m(∅). Sorted (layer, head) pairs."""
    nec, suf = normalized_effects(necessity, sufficiency, m_full, m_empty)
    hits = ((nec >= threshold) & (suf >= threshold)).nonzero().tolist()
    return [(int(layer), int(head)) for layer, head in hits]


def dcm_score(m_circuit: float, m_empty: float) -> float:
    """Differential Causal Mediation of a circuit C: DCM(C) = m(C) − m(∅), in nats.

    The summary of the paper describes DCM as how much causal signal about the model's behaviour
    the (preserved) circuit carries, higher for RL (15.8 vs 10.4 at epoch 1), without a formula.
    We read it as the difference in the behaviour metric mediated by C: the mean target
    log-probability when only C's heads take their clean activations (all others patched with
    the counterfactual) minus that of the fully patched model. It is unnormalised, so it rises
    with both the circuit's share of the effect and the size of the effect itself; on a tuned
    model the toolkit evaluates it for the preserved base circuit C_base ∩ C_ft.
    """
    return m_circuit - m_empty


@dataclass
class VulnerabilitySummary:
    score: torch.Tensor  # (L, H): m_b − m_a (positive: the head falls more under objective a)
    labels: list[list[Vulnerability]]
    per_layer: list[dict[str, float]]
    overall: dict[str, float]


def differential_vulnerability(
    mask_a: torch.Tensor,
    mask_b: torch.Tensor,
    delta: float = 0.1,
    within: torch.Tensor | None = None,
) -> VulnerabilitySummary:
    """Differential circuit vulnerability between two training objectives a and b (e.g. SFT and
    RL from the same base): head h is a-vulnerable when m_a,h < m_b,h − δ, b-vulnerable when
    m_b,h < m_a,h − δ, else neutral. ``within`` (e.g. the base circuit) restricts the heads
    counted; per layer and overall: counts, shares among counted heads and the mean score."""
    score = (mask_b.float() - mask_a.float()).cpu()
    keep = torch.ones_like(score, dtype=torch.bool) if within is None else within.bool().cpu()
    labels: list[list[Vulnerability]] = [
        ["a_vulnerable" if s > delta else "b_vulnerable" if s < -delta else "neutral" for s in row]
        for row in score.tolist()
    ]
    per_layer = [_tally(labels[i], keep[i], score[i]) for i in range(score.size(0))]
    flat_labels = [lab for row in labels for lab in row]
    overall = _tally(flat_labels, keep.flatten(), score.flatten())
    return VulnerabilitySummary(score, labels, per_layer, overall)


def _tally(
    labels: list[Vulnerability], keep: torch.Tensor, score: torch.Tensor
) -> dict[str, float]:
    chosen = [lab for lab, k in zip(labels, keep.tolist(), strict=True) if k]
    n = len(chosen)
    out: dict[str, float] = {"heads": float(n)}
    for name in ("a_vulnerable", "b_vulnerable", "neutral"):
        count = chosen.count(name)  # type: ignore[arg-type]
        out[name] = float(count)
        out[f"{name}_share"] = count / n if n else 0.0
    out["mean_score"] = float(score[keep].mean()) if n else 0.0
    return out
