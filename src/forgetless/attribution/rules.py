"""LRP rules in Gradient×Input form: each rule is a forward op with a modified backward.

With these backwards, ``t ⊙ ∂t`` is the LRP relevance of any tensor ``t`` (activations and
parameters alike) for the output the backward starts from. Rules (AttnLRP, Achtibat et al. 2024,
"AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers", ICML):

- linear maps (projections, rotary embedding, head reshapes): the plain gradient (LRP-0; a
  bias keeps its share ``b ⊙ ∂b``);
- product of two activations (SwiGLU's ``act(gate) · up``, ``Q Kᵀ``, ``A V``): the uniform rule,
  half of the output relevance to each factor (their Prop. 3.3): the gradient of each factor is
  halved;
- element-wise activation ``f`` (SiLU): the identity rule ``R_in = R_out``: the backward is
  ``∂out · f(x)/x``, which for SiLU is ``∂out · σ(x)`` (no division);
- RMSNorm: the identity rule, the normalizing factor treated as a constant (detached);
- softmax: AttnLRP's rule ``R_x = x ⊙ (R_s − s Σ R_s)`` (their Prop. 3.1), which in this form is
  the plain softmax gradient times the input: nothing to change.

Every rule except softmax (whose missing share is absorbed by the bias of its Taylor expansion)
conserves relevance exactly: the inputs' relevance sums to the output's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _UniformProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return 0.5 * grad * b, 0.5 * grad * a


class _UniformMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return 0.5 * (grad @ b.transpose(-1, -2)), 0.5 * (a.transpose(-1, -2) @ grad)


class _IdentitySiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return nn.functional.silu(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(x)


def uniform_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b`` (same shapes) whose backward gives each factor half of the relevance."""
    return _UniformProduct.apply(a, b)  # type: ignore[no-any-return]


def uniform_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` whose backward gives each factor half of the relevance (bilinear rule)."""
    return _UniformMatmul.apply(a, b)  # type: ignore[no-any-return]


def identity_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU whose backward passes relevance through unchanged (``∂x = ∂y · σ(x)``)."""
    return _IdentitySiLU.apply(x)  # type: ignore[no-any-return]


def identity_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the normalizer detached (identity rule), computed like Llama's in float32."""
    dtype = x.dtype
    hidden = x.to(torch.float32)
    scale = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps).detach()
    return weight * (hidden * scale).to(dtype)


def repeat_heads(states: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``groups`` query heads."""
    if groups == 1:
        return states
    batch, heads, length, dim = states.shape
    expanded = states[:, :, None].expand(batch, heads, groups, length, dim)
    return expanded.reshape(batch, heads * groups, length, dim)


def lrp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with the bilinear rule on ``Q Kᵀ`` and ``A V`` (an HF attention function)."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    keys, values = repeat_heads(key, groups), repeat_heads(value, groups)
    scores = uniform_matmul(query, keys.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = uniform_matmul(weights, values).transpose(1, 2).contiguous()
    return out, weights
