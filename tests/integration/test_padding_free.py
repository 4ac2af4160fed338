"""Padding-free batches (``train.padding_free``): the packed row's loss and gradients are the
padded batch's, per-task padding is reported, methods that read rows are refused at validate,
and an attention that cannot keep packed sequences apart falls back to length grouping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, tiny_run_config
from rich.console import Console

from forgetless.config.loading import validate_config
from forgetless.config.schema import method_config
from forgetless.contract.method import create_method
from forgetless.contract.plan import TrainPlan
from forgetless.engine import packing
from forgetless.engine.loop import StepLoop, batches, causal_lm_loss
from forgetless.errors import ConfigError, TrainingError
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.tasks.formatting import IGNORE_INDEX, collate
from forgetless.testing import task_context
from forgetless.training.runner import Runner

TRAIN = {"steps": 3, "batch_size": 8, "lr": 1e-3, "max_length": 48}


def tiny(attention: str) -> torch.nn.Module:
    model = build_tiny_model(TINY, vocab_size=len(build_char_tokenizer()), seed=0)
    model.config._attn_implementation = attention
    return model


def loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor], inputs: dict[str, Any]):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model(**inputs, use_cache=False).logits, batch["labels"])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_loss_and_gradients_equal_the_padded_batch(attention: str) -> None:
    model = tiny(attention)
    feats = task_context(model, ["reverse", "cipher"], index=2, n_train=8).train_features
    assert len({len(f["input_ids"]) for f in feats}) > 1, "lengths must differ to pad"
    padded = collate(feats, pad_id=0)
    packed = packing.pack(feats)
    assert packed["input_ids"].shape == (1, sum(len(f["input_ids"]) for f in feats))
    assert int((packed["labels"] != IGNORE_INDEX).sum()) == int(
        (padded["labels"][:, 1:] != IGNORE_INDEX).sum()
    )
    want, want_grads = loss_and_grads(
        model,
        padded,
        {"input_ids": padded["input_ids"], "attention_mask": padded["attention_mask"]},
    )
    got, got_grads = loss_and_grads(
        model, packed, {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]}
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_pack_ignores_each_first_label_and_restarts_positions() -> None:
    feats = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    packed = packing.pack(feats)
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert packed["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9]]
    assert packing.padding_share(packed) == (0, 5)
    assert packing.padding_share(collate(feats, pad_id=0)) == (1, 6)


def loop_run(method: str, padding_free: bool, steps: int = 3, task: int = 2):
    model = tiny("sdpa")
    ctx = task_context(model, ["reverse", "cipher"], index=task, n_train=16)
    loop = StepLoop(model, create_method(method_config({"name": method})), ctx, pad_id=0)
    plan = TrainPlan(steps=steps, batch_size=4, lr=1e-3, seed=0, padding_free=padding_free)
    return loop.run(ctx.train_features, plan), model


@pytest.mark.parametrize("method", ["seq_ft", "ewc"])
def test_the_loop_trains_the_same_weights_packed(method: str) -> None:
    padded, padded_model = loop_run(method, padding_free=False)
    packed, packed_model = loop_run(method, padding_free=True)
    assert padded.padding_fraction is not None and padded.padding_fraction > 0
    assert packed.padding_fraction == 0.0 and packed.tokens == padded.tokens
    torch.testing.assert_close(packed.losses, padded.losses, atol=1e-5, rtol=0)
    for (name, a), b in zip(
        packed_model.named_parameters(), padded_model.parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


def run(model_dir: Path, out: Path, method: Any, padding_free: bool) -> dict[str, Any]:
    train = {**TRAIN, "padding_free": padding_free}
    cfg = validate_config(tiny_run_config(model_dir, train=train, method=method))
    return Runner(cfg, out, Console(quiet=True), progress=False).run().to_json()


@pytest.mark.parametrize(
    "method",
    [
        {"name": "replay", "buffer_size": 16, "ratio": 0.5},
        {"name": "ewc", "lam": 1e5, "fisher_samples": 8, "fisher_batch_size": 4},
    ],
)
def test_a_run_reports_padding_per_task_and_trains_the_same_packed(
    tiny_model_dir: Path, tmp_path: Path, method: dict[str, Any]
) -> None:
    """Replay packs its mixed-in memory; EWC's penalty reads weights and its Fisher pass
    collates its own padded batches, so both train the same weights packed."""
    padded = run(tiny_model_dir, tmp_path / "padded", method, padding_free=False)
    packed = run(tiny_model_dir, tmp_path / "packed", method, padding_free=True)
    assert [t["padding_fraction"] for t in packed["per_task"]] == [0.0, 0.0]
    assert all(0 < t["padding_fraction"] < 1 for t in padded["per_task"])
    for a, b in zip(packed["per_task"], padded["per_task"], strict=True):
        assert a["losses"] == pytest.approx(b["losses"], abs=1e-5)
    assert packed["accuracy_matrix"] == padded["accuracy_matrix"]


@pytest.mark.parametrize(
    ("method", "why"),
    [
        ({"name": "kl_sft"}, "adds loss terms that read the logits"),
        ({"name": "asft"}, "replaces the task loss"),
        ({"name": "sae_fd"}, "reads activations through hooks"),
        ({"name": "attribution_gate"}, "reads activations through hooks"),
        ({"name": "anchored"}, "trains in a stage of its own"),
    ],
)
def test_methods_that_read_rows_are_refused_at_validate(
    tiny_model_dir: Path, method: dict[str, Any], why: str
) -> None:
    raw = tiny_run_config(tiny_model_dir, train={**TRAIN, "padding_free": True}, method=method)
    with pytest.raises(ConfigError, match=f"does not train on padding-free batches: it {why}"):
        validate_config(raw)
    raw["train"]["padding_free"] = False
    validate_config(raw)


def test_the_loop_refuses_a_method_handed_over_directly() -> None:
    with pytest.raises(TrainingError, match="padding-free"):
        loop_run("kl_sft", padding_free=True, steps=1, task=1)


def test_an_attention_that_cannot_pack_groups_lengths_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packing, "PACKED_ATTENTION", frozenset())
    padded, _ = loop_run("seq_ft", padding_free=False, steps=4)
    with pytest.warns(UserWarning, match="similar length") as said:
        grouped, _ = loop_run("seq_ft", padding_free=True, steps=4)
    assert len([w for w in said if "similar length" in str(w.message)]) == 1
    assert grouped.padding_fraction is not None and padded.padding_fraction is not None
    assert grouped.padding_fraction < padded.padding_fraction


def test_length_grouped_batches_keep_every_example_once_per_epoch() -> None:
    feats = [{"input_ids": [1] * n, "labels": [1] * n} for n in [9, 2, 7, 3, 8, 1, 6, 4]]
    epoch = [
        f
        for _, batch in zip(range(4), batches(feats, 2, seed=0, grouped=True), strict=False)
        for f in batch
    ]
    assert sorted(len(f["input_ids"]) for f in epoch) == sorted(len(f["input_ids"]) for f in feats)
    pairs = [epoch[i : i + 2] for i in range(0, 8, 2)]
    assert [[len(f["input_ids"]) for f in p] for p in pairs] == [[9, 8], [7, 6], [4, 3], [2, 1]]
