"""The output layer's input made contiguous while a loop trains.

With ``logits_to_keep`` transformers slices the last hidden states to the completion window
before the output layer; the slice is a strided view, and a linear layer on a strided 3-D input
runs as a batched matmul with its weight broadcast over the batch (``aten::bmm``). On
SmolLM2-135M (a 49152 × 576 output layer, batch 8 × 61 tokens) that layer's forward and
backward took 0.35 s as a slice and 0.09 s made contiguous (issue 50's profile). The copy is
batch × window × hidden values; a contiguous input is passed through untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def contiguous_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A forward pre-hook: the first argument as a contiguous tensor (None: left as it is)."""
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


@contextmanager
def contiguous_output_layer(model: nn.Module) -> Iterator[None]:
    """The hook on ``model``'s output embeddings for the block (none when it has no
    ``get_output_embeddings``, e.g. a bare module in a test)."""
    getter = getattr(model, "get_output_embeddings", None)
    layer = getter() if callable(getter) else None
    handle = layer.register_forward_pre_hook(contiguous_input) if layer is not None else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
