from pathlib import Path

from forgetless.report.plots import point_style, tradeoff


def test_no_two_variants_of_a_large_campaign_share_a_style() -> None:
    styles = [point_style(i) for i in range(80)]
    assert len(set(styles)) == 80
    assert point_style(0) != point_style(10)  # tab10 repeats its colour at eleven variants


def _stats(mean: float) -> dict[str, float]:
    return {"mean": mean, "low": mean - 0.05, "high": mean + 0.05, "n": 3}


def test_the_tradeoff_figure_draws_more_variants_than_colours(tmp_path: Path) -> None:
    rows = [
        {"variant": f"v{i}", "gain": _stats(i / 20), "retention": _stats(1 - i / 20)}
        for i in range(17)
    ]
    path = tradeoff(rows, tmp_path / "frontier.png")
    assert path.stat().st_size > 1000
