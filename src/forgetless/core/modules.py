"""Small helpers on torch modules that several floors share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from torch import nn

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def freeze(module: ModuleT) -> ModuleT:
    """Eval mode, no gradients: a fixed teacher, reference or feature basis (returned, so a
    caller can chain ``.to(device)``)."""
    module.eval()
    for param in module.parameters():
        param.requires_grad_(False)
    return module


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable parameters by name (for a LoRA carry run: the one adapter's weights)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout) for the block, its own mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
