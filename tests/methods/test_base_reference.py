"""The base model's logits beside a LoRA step: the adapter-free forward resumed from the
training forward's hidden state below the lowest adapted layer equals a full base forward, skips
the layers below, and falls back to full forwards where a layout does not agree."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import moved_lora
from transformers import AutoModelForCausalLM

from forgetless.contract.method import StepContext
from forgetless.methods.base_reference import BaseReference
from forgetless.methods.shared_prefix import agrees, decoder_stack, lowest_adapted_layer
from forgetless.tasks.formatting import collate, completion_window
from forgetless.testing import task_context


def calls_of(module: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def started(model: Any) -> tuple[BaseReference, Any, dict[str, torch.Tensor]]:
    ctx = task_context(model, ["reverse"], n_train=4, finetune_mode="lora", lora_regime="carry")
    reference = BaseReference("test")
    reference.start(ctx)
    return reference, ctx, collate(ctx.train_features, ctx.tokenizer.pad_token_id)


def train_forward(model: Any, batch: dict[str, torch.Tensor], keep: int) -> Any:
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    return model(**inputs, logits_to_keep=keep, use_cache=False)


def test_the_adapted_layers_alone_run_again_and_give_the_base_logits(
    tiny_model_dir: Path,
) -> None:
    model = moved_lora(tiny_model_dir, target_modules=["q_proj", "v_proj"], layers_to_transform=[1])
    reference, ctx, batch = started(model)
    assert reference.prefix is not None and reference.prefix.start == 1
    keep = completion_window(batch["labels"])
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    with torch.no_grad():
        expected = base(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            logits_to_keep=keep,
        ).logits
    lower, upper = (
        calls_of(decoder_stack(model).layers[0]),
        calls_of(decoder_stack(model).layers[1]),
    )
    step = StepContext(ctx, 0, 1)
    for first in (True, False):
        train_forward(model, batch, keep)
        lower.clear(), upper.clear()
        got = reference.logits(batch, step, keep)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert len(upper) == (2 if first else 1)  # the first pass is checked by a full one
        assert len(lower) == (1 if first else 0)  # then the layers below are not run again
    assert reference.prefix is not None and model.training


def test_a_layout_that_does_not_agree_falls_back_to_full_forwards(tiny_model_dir: Path) -> None:
    model = moved_lora(tiny_model_dir, target_modules=["q_proj"], layers_to_transform=[1])
    reference, ctx, batch = started(model)
    assert reference.prefix is not None
    stack = reference.prefix.stack  # a step after the head that the resumed pass leaves out
    reference.prefix.stack = dataclasses.replace(stack, head=lambda h: 2.0 * stack.head(h))
    keep = completion_window(batch["labels"])
    train_forward(model, batch, keep)
    got = reference.logits(batch, StepContext(ctx, 0, 1), keep)
    assert reference.prefix is None  # dropped: later steps run the whole base forward
    with torch.no_grad(), model.disable_adapter():
        model.eval()
        expected = train_forward(model, batch, keep).logits
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("lora", "start"),
    [
        ({"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]}, 1),
        ({"target_modules": ["q_proj"]}, None),  # every layer: nothing below to share
        ({"target_modules": r".*(layers\.1\.self_attn\.q_proj|embed_tokens)"}, None),  # embeddings
    ],
)
def test_the_shared_prefix_ends_at_the_lowest_adapter(
    lora: dict[str, Any], start: int | None, tiny_model_dir: Path
) -> None:
    model = moved_lora(tiny_model_dir, **lora)
    stack = decoder_stack(model)
    assert stack is not None and len(stack.layers) == 2
    assert lowest_adapted_layer(model, stack) == start


def test_agrees_holds_rounding_and_rejects_a_change() -> None:
    full = torch.randn(2, 3, 7) * 10
    assert agrees(full + 1e-4, full)
    assert not agrees(full * 1.01, full)
    assert not agrees(full[:, 1:], full)
