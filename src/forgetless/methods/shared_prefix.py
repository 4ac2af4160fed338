"""The base model's forward resumed from the training forward's hidden state, where the two
cannot differ: below the lowest decoder layer that carries a LoRA adapter, the trained model
and the base (adapters off) compute the same hidden states, so a reference pass need only run
the adapted layers, the final norm and the output layer. On SmolLM2-135M with LoRA on layers
22–29 that is 8 of 30 layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DecoderStack:
    """A causal LM's decoder layers, final norm and output layer (Llama, Qwen2, Mistral, ...)."""

    layers: nn.ModuleList
    norm: nn.Module
    head: nn.Module


def decoder_stack(model: nn.Module) -> DecoderStack | None:
    """The stack of a transformers causal LM (under PEFT or not); None for another layout."""
    getter = getattr(model, "get_base_model", None)
    lm = getter() if callable(getter) else model
    inner = getattr(lm, "model", None)
    layers, norm = getattr(inner, "layers", None), getattr(inner, "norm", None)
    output_embeddings = getattr(lm, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    if not isinstance(layers, nn.ModuleList) or norm is None or head is None:
        return None
    return DecoderStack(layers, norm, head)


def _adapted(module: nn.Module) -> bool:
    return any(hasattr(m, "lora_A") for m in module.modules())


def lowest_adapted_layer(model: nn.Module, stack: DecoderStack) -> int | None:
    """The index of the first decoder layer with an adapter, when every adapter sits in the
    layers (none in the embeddings); None when nothing can be shared."""
    inside = {id(m) for layer in stack.layers for m in layer.modules()}
    outside = [m for m in model.modules() if hasattr(m, "lora_A") and id(m) not in inside]
    adapted = [i for i, layer in enumerate(stack.layers) if _adapted(layer)]
    if outside or not adapted or adapted[0] == 0:
        return None
    return adapted[0]


@dataclass
class SharedPrefix:
    """Captures what enters layer ``start`` during each training forward, and resumes the
    forward from there (adapters switched off by the caller)."""

    stack: DecoderStack
    start: int
    captured: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    handle: Any = field(default=None, repr=False)

    def attach(self) -> None:
        self.handle = self.stack.layers[self.start].register_forward_pre_hook(
            self._capture, with_kwargs=True
        )

    def detach(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _capture(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module.training and torch.is_grad_enabled():  # a training forward
            hidden, rest = (args[0], args[1:]) if args else (kwargs["hidden_states"], ())
            kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            self.captured = ((hidden.detach(), *rest), kwargs)

    def ready_for(self, input_ids: torch.Tensor) -> bool:
        """Whether the last capture is this batch's (same rows and length)."""
        if self.captured is None:
            return False
        hidden = self.captured[0][0]
        return isinstance(hidden, torch.Tensor) and hidden.shape[:2] == input_ids.shape

    def logits(self, keep: int) -> torch.Tensor:
        """The rest of the forward from the capture: the logits of the last ``keep`` positions."""
        assert self.captured is not None, "ready_for() first"
        (hidden, *rest), kwargs = self.captured
        self.captured = None  # one reference pass per training forward
        for layer in self.stack.layers[self.start :]:
            out = layer(hidden, *rest, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        hidden = self.stack.norm(hidden[:, -keep:, :]).contiguous()
        return self.stack.head(hidden)


def shared_prefix(model: nn.Module) -> SharedPrefix | None:
    """A prefix shared with the base for ``model`` (attached), or None when its adapters start
    at the first layer, sit outside the decoder layers, or the layout is not a known one."""
    stack = decoder_stack(model)
    start = lowest_adapted_layer(model, stack) if stack is not None else None
    if stack is None or start is None:
        return None
    prefix = SharedPrefix(stack, start)
    prefix.attach()
    return prefix


def agrees(shared: torch.Tensor, full: torch.Tensor) -> bool:
    """Whether the resumed forward's logits are the full forward's, to rounding: a layout with
    a step after the norm (a logit soft-cap, say) fails and falls back to full forwards."""
    scale = full.abs().max().clamp_min(1.0)
    return shared.shape == full.shape and bool((shared - full).abs().max() <= 1e-3 * scale)
