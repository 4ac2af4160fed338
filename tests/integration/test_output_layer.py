"""While a loop trains, the output layer reads a contiguous input: transformers' completion
window (``logits_to_keep``) is a strided slice, which a linear layer runs as a batched matmul
with its weight broadcast over the batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TINY

from forgetless.config.schema import FinetuneConfig, method_config
from forgetless.contract.method import create_method
from forgetless.contract.plan import TrainPlan
from forgetless.engine.loop import StepLoop
from forgetless.models.finetuner import Finetuner
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.testing import task_context


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_the_output_layer_reads_a_contiguous_window(mode: str) -> None:
    model = build_tiny_model(TINY, vocab_size=len(build_char_tokenizer()), seed=0)
    finetuner = Finetuner(model, FinetuneConfig(mode=mode))  # type: ignore[call-arg]
    finetuner.begin_task(1)
    model = finetuner.model
    seen: list[tuple[int, bool]] = []

    def record(_module: torch.nn.Module, args: tuple[Any, ...], _out: Any) -> None:
        seen.append((args[0].shape[1], args[0].is_contiguous()))

    layer = model.get_output_embeddings()
    handle = layer.register_forward_hook(record)
    ctx = task_context(model, ["reverse"], n_train=16)
    loop = StepLoop(model, create_method(method_config("seq_ft")), ctx, pad_id=0)
    loop.run(ctx.train_features, TrainPlan(steps=2, batch_size=4, lr=1e-3, seed=0))
    handle.remove()
    lengths = [len(f["input_ids"]) for f in ctx.train_features]
    assert seen and all(window < max(lengths) for window, _ in seen)  # a real window, a slice
    assert all(contiguous for _, contiguous in seen)
    assert len(layer._forward_pre_hooks) == 0  # the loop's hook is gone after it
