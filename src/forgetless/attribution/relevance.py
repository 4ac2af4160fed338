"""Parameter relevance of a Llama/Qwen2-style model: ``R_θ = θ ⊙ ∂θ`` under the LRP backward.

``lrp_mode(model)`` switches a model to the rules of ``attribution.rules`` for the duration of a
``with`` block (attention in eager form, SwiGLU MLPs, RMSNorms); everything else, LoRA layers
included, keeps its plain gradient, which is the LRP-0 rule for linear maps. The backward starts
from the predicted next-token logit at each completion position (Liu et al. 2026,
"Attribution-Guided Continual Learning for Large Language Models", arXiv:2605.05285, §3).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from forgetless.attribution.rules import (
    identity_rmsnorm,
    identity_silu,
    lrp_attention,
    uniform_product,
)
from forgetless.errors import ForgetlessError
from forgetless.tasks.formatting import IGNORE_INDEX

LRP_ATTENTION = "forgetless_lrp"
SUPPORTED_ACTIVATIONS = ("silu", "swish")


class RelevanceError(ForgetlessError):
    """The model has a block the LRP rules do not cover."""


def _register_attention() -> None:
    AttentionInterface.register(LRP_ATTENTION, lrp_attention)
    AttentionMaskInterface.register(LRP_ATTENTION, eager_mask)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate = identity_silu(self.gate_proj(x))  # type: ignore[operator]
    return self.down_proj(uniform_product(gate, self.up_proj(x)))  # type: ignore[operator,no-any-return]


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    return identity_rmsnorm(x, self.weight, float(eps))  # type: ignore[arg-type]


def _is_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _is_attention(module: nn.Module) -> bool:
    return hasattr(module, "o_proj") and hasattr(module, "config")


def _check_activation(module: nn.Module) -> None:
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    if act not in SUPPORTED_ACTIVATIONS:
        raise RelevanceError(
            f"{type(module).__name__}: activation {act!r} has no identity rule here "
            f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
        )


def _patch_targets(model: nn.Module) -> tuple[list[tuple[nn.Module, Any]], list[Any]]:
    """Patch MLP and norm forwards (remembering any instance-level forward) and find configs."""
    patched: list[tuple[nn.Module, Any]] = []
    configs: list[Any] = []
    for module in model.modules():
        rule = _mlp_forward if _is_mlp(module) else None
        if rule is None and type(module).__name__.endswith("RMSNorm"):
            rule = _norm_forward
        if rule is not None:
            if rule is _mlp_forward:
                _check_activation(module)
            patched.append((module, module.__dict__.get("forward")))
            module.forward = types.MethodType(rule, module)  # type: ignore[method-assign]
        elif _is_attention(module) and all(module.config is not c for c in configs):
            configs.append(module.config)
    if not configs:
        raise RelevanceError(f"{type(model).__name__}: no attention module with o_proj found")
    return patched, configs


@contextmanager
def lrp_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, backward passes of ``model`` follow the LRP rules; restored on exit."""
    _register_attention()
    patched, configs = _patch_targets(model)
    saved = [c._attn_implementation for c in configs]
    try:
        for config in configs:
            config._attn_implementation = LRP_ATTENTION
        yield model
    finally:
        for config, name in zip(configs, saved, strict=True):
            config._attn_implementation = name
        for module, previous in patched:
            if previous is None:
                del module.forward
            else:
                module.forward = previous


@dataclass
class SampleRelevance:
    """One example's parameter relevance and whether greedy decoding reproduces its completion."""

    correct: bool
    relevance: dict[str, torch.Tensor]


def target_positions(labels: torch.Tensor) -> torch.Tensor:
    """Positions whose logits predict a completion token (labels shifted left by one)."""
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return mask


@contextmanager
def _all_parameters_require_grad(model: nn.Module) -> Iterator[None]:
    flags = {p: p.requires_grad for p in model.parameters()}
    try:
        for param in flags:
            param.requires_grad_(True)
        yield
    finally:
        for param, flag in flags.items():
            param.requires_grad_(flag)


def sample_relevance(
    model: nn.Module, batch: dict[str, torch.Tensor], names: set[str] | None = None
) -> SampleRelevance:
    """Relevance of the predicted logits at one example's completion positions, per parameter.

    ``batch`` holds one example (``input_ids``, ``attention_mask``, ``labels``). The example is
    correct when the argmax at every completion position is the reference token, which is
    exactly when greedy decoding reproduces the completion. ``names`` limits the parameters kept.
    For many examples, ``relevance_session`` sets the model up once.
    """
    with relevance_session(model, names) as score:
        return score(batch)


class Scorer(Protocol):
    """``sample_relevance`` for one example, the model already set up (``relevance_session``)."""

    def __call__(
        self, batch: dict[str, torch.Tensor], correct_only: bool = False
    ) -> SampleRelevance: ...


@contextmanager
def relevance_session(model: nn.Module, names: set[str] | None = None) -> Iterator[Scorer]:
    """Set ``model`` up for relevance once (eval mode, every parameter requiring grad, the LRP
    rules) and yield ``score(batch, correct_only=False)``, ``sample_relevance`` for one example
    of ``batch``. With ``correct_only``, a wrong example skips the backward pass and comes back
    with no relevance (callers that keep only correct samples pay one forward for it)."""
    was_training = model.training
    model.eval()
    kept = [(n, p) for n, p in model.named_parameters() if names is None or n in names]

    def score(batch: dict[str, torch.Tensor], correct_only: bool = False) -> SampleRelevance:
        if batch["input_ids"].shape[0] != 1:
            raise ValueError("sample_relevance takes one example at a time")
        model.zero_grad(set_to_none=True)
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
        where = target_positions(batch["labels"])
        picked = logits[where]
        predicted = picked.argmax(-1)
        correct = bool((predicted == batch["labels"][:, 1:][where[:, :-1]]).all())
        if correct_only and not correct:
            return SampleRelevance(False, {})
        picked.gather(-1, predicted[:, None]).sum().backward()
        relevance = {n: (p.detach() * p.grad).float() for n, p in kept if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return SampleRelevance(correct, relevance)

    try:
        with _all_parameters_require_grad(model), lrp_mode(model), torch.enable_grad():
            yield score
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
