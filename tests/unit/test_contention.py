"""A bench record names the load beside its run, so cost ratios compare only undisturbed runs."""

from __future__ import annotations

import pytest
import torch

from forgetless.bench import campaign


@pytest.mark.parametrize(
    ("start", "end", "shared"),
    [(0.1, 1.2, False), (1.4, 1.3, True), (0.2, 3.5, True), (None, 1.0, None), (None, 9.0, True)],
)
def test_shared_cores_from_the_load_at_both_ends(
    monkeypatch: pytest.MonkeyPatch, start: float | None, end: float, shared: bool | None
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(campaign, "load_average", lambda: end)
    found = campaign.contention(start)
    assert found == {"load_start": start, "load_end": end, "shared_cores": shared}


def test_every_record_carries_its_contention() -> None:
    record = campaign.provenance(0.0)
    assert set(record["contention"]) == {"load_start", "load_end", "shared_cores"}
    assert record["machine"]["threads"] == torch.get_num_threads()
