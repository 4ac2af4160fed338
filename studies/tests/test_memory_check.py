"""The memory check counts what a method keeps, and compares it with the memory model fairly."""

from __future__ import annotations

import torch
from memory_check import live_tensors
from memory_model import check_table, predicted_copies


def test_live_tensors_see_a_new_storage_once_and_the_gradients() -> None:
    before = live_tensors()[0]
    weight = torch.zeros(10_000, requires_grad=True)
    view = weight[:10]  # a view shares the storage: not counted twice
    weight.sum().backward()
    grown = live_tensors()[0] - before
    assert 20_000 <= grown < 21_000, grown
    assert view.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()


def test_the_models_copies_count_a_reference_over_all_weights() -> None:
    full = {"trainable": 1000, "weights": 1000}
    lora = {"trainable": 10, "weights": 1000}
    assert predicted_copies("ewc", full) == 2.0  # Fisher and anchor
    assert predicted_copies("seq_ft", full) == 0.0
    assert predicted_copies("kl_sft", lora) == 100.0  # a whole frozen model, per LoRA weight
    # anchored's two frozen copies are of the adapted model: each holds the adapters too
    assert predicted_copies("anchored", lora | {"mode": "lora"}) == 2 * 101.0


def test_a_mismatch_is_marked_in_the_table() -> None:
    rows = [
        {"method": m, "mode": "full", "measured_copies": q, "trainable": 10, "weights": 10}
        | {"extra_bytes_per_trainable": 4 * q}
        for m, q in (("ewc", 2.02), ("kl_sft", 0.0))
    ]
    table = check_table({"rows": rows})
    assert "| `ewc` | full | 2.00 | 2.02 | 8.1 | yes |" in table
    assert "| `kl_sft` | full | 1.00 | 0.00 | 0.0 | **no** |" in table
