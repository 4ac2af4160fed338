"""The verdict rule every claim and campaign table uses: intervals decide, not means."""

from __future__ import annotations

import pytest

from forgetless.bench.stats import at_bound, paired_verdict


@pytest.mark.parametrize(
    ("diffs", "expected", "verdict"),
    [
        ([0.10, 0.12, 0.11], 1, "supported"),
        ([0.10, 0.12, 0.11], -1, "refuted"),
        ([-0.10, -0.12, -0.11], -1, "supported"),
        ([0.20, -0.05, 0.10], 1, "inconclusive"),  # the mean is positive, the interval holds 0
        ([0.30], 1, "exploratory"),
        ([0.20, 0.21], 1, "exploratory"),  # two seeds exclude zero here, but a verdict needs 3
        ([], 1, "not measured"),
    ],
)
def test_paired_verdict(diffs: list[float], expected: int, verdict: str) -> None:
    assert paired_verdict(diffs, expected) == verdict


def test_floor_and_ceiling_make_a_claim_untestable() -> None:
    assert at_bound([0.0, 0.0], [0.0]) and at_bound([1.0], [1.0, 1.0])
    assert not at_bound([0.0, 0.2], [0.0]) and not at_bound([0.0], [1.0]) and not at_bound()
    assert paired_verdict([0.5, 0.6], 1, untestable=True) == "not testable here"


def test_the_campaign_key_ignores_defaults_but_not_the_method() -> None:
    from forgetless.bench.campaign import config_key
    from forgetless.config.loading import validate_config
    from forgetless.config.presets import smollm2_config_dict

    data = smollm2_config_dict()
    key = config_key(validate_config(data))
    data["train"]["optimizer_restarts"] = 0  # an option at its default: the same runs
    assert config_key(validate_config(data)) == key
    data["train"]["optimizer_restarts"] = 4
    assert config_key(validate_config(data)) != key
    data["train"]["optimizer_restarts"] = 0
    data["method"] = {"name": "kl_sft"}  # every setting at its default, another method
    assert config_key(validate_config(data)) != key
