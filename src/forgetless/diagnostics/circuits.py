"""Head-level circuits by differentiable binary masking (DBM), and per-head causal effects.

Every attention head ``h`` of layer ``l`` writes through ``o_proj``, whose input is the heads'
outputs side by side (``num_attention_heads × head_dim``; grouped-query attention shares keys and
values, not outputs, so this holds for it too). A forward pre-hook on each ``o_proj`` replaces
head ``h``'s slice ``x_h`` by ``m·x_h + (1 − m)·x̃_h``: ``m = 1`` keeps the live (clean) activation,
``m = 0`` patches in the counterfactual ``x̃`` (the head's mean activation over the behaviour's
tokens, or its activation on a corrupted prompt of the same length). Masks may differ per batch
row, so many masked variants of a prompt batch run in **one** forward pass.

DBM (as used in "Mechanistic origins of catastrophic forgetting: why RL preserves circuits better
than SFT?", summary in shared/papers/000): a logit ``ℓ`` per head, ``m = σ(ℓ/τ)``, trained to raise
the target answer's log-probability with a sparsity penalty on ``Σ m``; the circuit is
``{h : m_h > 0.5}``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from forgetless.tasks.formatting import IGNORE_INDEX, completion_window

Batch = dict[str, torch.Tensor]
Counterfactual = list[torch.Tensor]
"""Per layer, ``(1 | B, 1 | T, H, D)``: what a head becomes when its mask is 0."""


@dataclass(frozen=True)
class HeadLayout:
    layers: int
    heads: int
    head_dim: int

    @property
    def size(self) -> int:
        return self.layers * self.heads


def head_layout(model: nn.Module) -> HeadLayout:
    """Layers, attention heads and head width of a Llama/Qwen2-style model (or its PEFT wrap)."""
    config: Any = model.config
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return HeadLayout(int(config.num_hidden_layers), heads, head_dim)


def o_proj_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's attention output projection, in layer order."""
    found = [m for n, m in model.named_modules() if n.endswith("self_attn.o_proj")]
    layout = head_layout(model)
    if len(found) != layout.layers:
        raise ValueError(f"found {len(found)} self_attn.o_proj modules for {layout.layers} layers")
    return found


def target_logprob(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(B,)`` log-probability of each row's target tokens (labels ≠ -100), summed over them.
    ``logits`` may cover only the trailing positions (``completion_window``)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = labels[:, -logits.shape[1] :][:, 1:]
    keep = target != IGNORE_INDEX
    picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * keep).sum(dim=1)


@contextlib.contextmanager
def capture_heads(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Record each layer's per-head ``o_proj`` input ``(B, T, H, D)`` during the forward passes
    run inside the block (the last pass wins)."""
    layout, modules = head_layout(model), o_proj_modules(model)
    store: list[torch.Tensor] = [torch.empty(0) for _ in modules]

    def hook(index: int) -> Any:
        def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            store[index] = x.detach().view(*x.shape[:-1], layout.heads, layout.head_dim)

        return pre

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(modules)]
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def head_activations(model: nn.Module, batch: Batch) -> list[torch.Tensor]:
    with capture_heads(model) as store:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return list(store)


def mean_counterfactual(acts: list[torch.Tensor], attention_mask: torch.Tensor) -> Counterfactual:
    """Each head's mean activation over the batch's real tokens, as ``(1, 1, H, D)``."""
    w = attention_mask.to(acts[0].dtype)[..., None, None]
    return [((a * w).sum((0, 1)) / w.sum((0, 1))).unsqueeze(0).unsqueeze(0) for a in acts]


def counterfactual(
    model: nn.Module, batch: Batch, kind: Literal["mean", "corrupt"], corrupt: Batch | None = None
) -> Counterfactual:
    """``mean``: mean ablation over the batch; ``corrupt``: each head's activation on the
    corrupted prompts (same shape as ``batch``), position by position."""
    if kind == "mean":
        return mean_counterfactual(head_activations(model, batch), batch["attention_mask"])
    if corrupt is None or corrupt["input_ids"].shape != batch["input_ids"].shape:
        raise ValueError("a corrupt counterfactual needs corrupted inputs of the batch's shape")
    return head_activations(model, corrupt)


@contextlib.contextmanager
def masked_heads(model: nn.Module, mask: torch.Tensor, cf: Counterfactual) -> Iterator[None]:
    """Inside the block, head (l, h) runs as ``m·x + (1 − m)·x̃`` with ``m = mask[..., l, h]``.

    ``mask`` is ``(L, H)`` (one mask for the batch) or ``(R, L, H)`` with one mask per row of a
    batch of ``R`` rows; counterfactuals of a ``B``-row batch are tiled when ``R = k·B``. At
    ``m = 1`` a head is exactly its clean value, at ``m = 0`` exactly the counterfactual.
    """
    layout = head_layout(model)
    if mask.shape[-2:] != (layout.layers, layout.heads):
        raise ValueError(f"mask shape {tuple(mask.shape)} != (…, {layout.layers}, {layout.heads})")

    def hook(index: int) -> Any:
        def pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            rows, tokens = x.shape[0], x.shape[1]
            xv = x.view(rows, tokens, layout.heads, layout.head_dim)
            m = mask[..., index, :].to(x.dtype)
            m = m.view(-1, 1, layout.heads, 1)
            alt = cf[index].to(x.dtype)
            if alt.size(0) not in (1, rows):
                alt = alt.repeat(rows // alt.size(0), 1, 1, 1)
            mixed = xv * m + alt * (1 - m)
            return (mixed.reshape(x.shape), *args[1:])

        return pre

    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(o_proj_modules(model))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def masked_logits(
    model: nn.Module, batch: Batch, mask: torch.Tensor, cf: Counterfactual
) -> torch.Tensor:
    """Logits of ``batch`` with the heads masked, over its completion window only (the prompt's
    logits are never read); rows are tiled when ``mask`` has more rows."""
    reps = mask.size(0) // batch["input_ids"].size(0) if mask.dim() == 3 else 1
    ids, attn = batch["input_ids"].repeat(reps, 1), batch["attention_mask"].repeat(reps, 1)
    keep = completion_window(batch["labels"])
    with masked_heads(model, mask, cf):
        out: torch.Tensor = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep).logits
    return out


def behaviour(model: nn.Module, batch: Batch, mask: torch.Tensor, cf: Counterfactual) -> float:
    """The behaviour metric m: mean target log-probability of the batch under ``mask``."""
    with torch.no_grad():
        return float(target_logprob(masked_logits(model, batch, mask, cf), batch["labels"]).mean())


# --- DBM ------------------------------------------------------------------------------------------


@dataclass
class DBMResult:
    logits: torch.Tensor  # (L, H) learned mask logits
    probs: torch.Tensor  # (L, H) σ(ℓ/τ) after training
    binary: torch.Tensor  # (L, H) bool, the circuit
    history: list[dict[str, float]] = field(default_factory=list)
    forward_passes: int = 0
    gap: float = 0.0  # mean |σ − round(σ)| of the final masks: 0 when they are binary


@contextlib.contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    flags = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(model.parameters(), flags, strict=True):
            p.requires_grad_(flag)
        model.train(was_training)


def mask_temperature(step: int, steps: int, start: float, end: float | None) -> float:
    """τ at ``step``: constant ``start``, or a geometric anneal from ``start`` to ``end`` (a low
    end drives σ(ℓ/τ) to 0 or 1, so the trained masks become binary)."""
    if end is None or steps < 2:
        return start
    return start * (end / start) ** (step / (steps - 1))


def mask_values(logits: torch.Tensor, temperature: float, straight_through: bool) -> torch.Tensor:
    """The masks a step applies: σ(ℓ/τ), or with ``straight_through`` the hard 0/1 masks in the
    forward pass and σ's gradient in the backward one."""
    probs = torch.sigmoid(logits / temperature)
    if not straight_through:
        return probs
    return (probs > 0.5).to(probs.dtype) + probs - probs.detach()


def train_masks(
    model: nn.Module,
    batch: Batch,
    cf: Counterfactual,
    steps: int = 200,
    lr: float = 0.1,
    temperature: float = 1.0,
    sparsity: float = 0.05,
    init: float = 3.0,
    log_every: int = 0,
    final_temperature: float | None = None,
    straight_through: bool = False,
) -> DBMResult:
    """Differentiable binary masks over all heads (one forward pass per step, all heads masked).

    Minimises ``−m(mask) + λ·Σ_h σ(ℓ_h/τ)`` over the mask logits ℓ (model frozen), with m the
    mean target log-probability and the mask ``σ(ℓ/τ)``; the circuit is ``σ(ℓ/τ) > 0.5``.
    ``init`` starts every head near clean (σ(3) ≈ 0.95) so training begins at the full model's
    behaviour. At a fixed τ the masks stay soft, so the trained and the thresholded circuit can
    differ: ``final_temperature`` anneals τ toward it, ``straight_through`` trains the hard
    masks themselves (``mask_values``). ``DBMResult.gap`` says how far from binary they ended.
    """
    layout = head_layout(model)
    device = batch["input_ids"].device
    logits = torch.full((layout.layers, layout.heads), init, device=device, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=lr)
    history: list[dict[str, float]] = []
    tau = temperature
    with _frozen(model):
        for step in range(steps):
            tau = mask_temperature(step, steps, temperature, final_temperature)
            masks = mask_values(logits, tau, straight_through)
            score = target_logprob(masked_logits(model, batch, masks, cf), batch["labels"]).mean()
            penalty = torch.sigmoid(logits / tau).sum()
            loss = -score + sparsity * penalty
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if log_every and (step % log_every == 0 or step == steps - 1):
                history.append(
                    {
                        "step": step,
                        "logprob": float(score.detach()),
                        "mask_sum": float(penalty.detach()),
                        "temperature": tau,
                    }
                )
    final = logits.detach()
    probs = torch.sigmoid(final / tau)
    gap = float((probs - probs.round()).abs().mean())
    return DBMResult(final, probs, probs > 0.5, history, forward_passes=steps, gap=gap)


# --- necessity and sufficiency --------------------------------------------------------------------


@dataclass
class HeadEffects:
    full: float  # m(M): every head clean
    empty: float  # m(∅): every head patched
    necessity: torch.Tensor  # (L, H): m(M) − m(M with head h patched)
    sufficiency: torch.Tensor  # (L, H): m(only h clean) − m(∅)
    forward_passes: int


def effect_masks(layout: HeadLayout) -> torch.Tensor:
    """The ``2N + 2`` masks of one effects pass: all clean, all patched, then each head patched
    alone (N), then each head alone clean (N)."""
    eye = torch.eye(layout.size).view(layout.size, layout.layers, layout.heads)
    ones = torch.ones(1, layout.layers, layout.heads)
    return torch.cat([ones, torch.zeros_like(ones), 1 - eye, eye])


def head_effects(
    model: nn.Module, batch: Batch, cf: Counterfactual, chunk: int | None = None
) -> HeadEffects:
    """Necessity and sufficiency of every head, batched: the prompt batch is tiled once per mask
    of :func:`effect_masks`, ``chunk`` masks per forward pass (default: all in one pass)."""
    layout = head_layout(model)
    masks = effect_masks(layout).to(batch["input_ids"].device)
    rows = batch["input_ids"].size(0)
    size = chunk or masks.size(0)
    scores, passes = [], 0
    with torch.no_grad():
        for lo in range(0, masks.size(0), size):
            part = masks[lo : lo + size]
            tiled = part.repeat_interleave(rows, dim=0)
            logits = masked_logits(model, batch, tiled, cf)
            labels = batch["labels"].repeat(part.size(0), 1)
            scores.append(target_logprob(logits, labels).view(part.size(0), rows).mean(1))
            passes += 1
    return _effects(torch.cat(scores), layout, passes)


def _effects(values: torch.Tensor, layout: HeadLayout, passes: int) -> HeadEffects:
    n = layout.size
    full, empty = float(values[0]), float(values[1])
    ablated, alone = values[2 : 2 + n], values[2 + n :]
    shape = (layout.layers, layout.heads)
    return HeadEffects(
        full,
        empty,
        (full - ablated).view(shape).cpu(),
        (alone - empty).view(shape).cpu(),
        passes,
    )


def mask_gradient(
    model: nn.Module, batch: Batch, cf: Counterfactual, at: float
) -> tuple[float, torch.Tensor]:
    """The behaviour m at every head's mask set to ``at``, and ∂m/∂mask there (one forward and
    one backward pass, the model frozen)."""
    layout = head_layout(model)
    mask = torch.full((layout.layers, layout.heads), at, device=batch["input_ids"].device)
    mask.requires_grad_(True)
    with _frozen(model):
        score = target_logprob(masked_logits(model, batch, mask, cf), batch["labels"]).mean()
        (grad,) = torch.autograd.grad(score, mask)
    return float(score.detach()), grad.detach()


def head_effects_attribution(model: nn.Module, batch: Batch, cf: Counterfactual) -> HeadEffects:
    """Necessity and sufficiency to first order (attribution patching): two forward and two
    backward passes for all heads instead of ``2N + 2`` forward passes.

    Patching head h alone moves its mask from 1 to 0, so m(M) − m(M with h patched) ≈ ∂m/∂m_h at
    the all-clean masks; keeping it alone clean moves it from 0 to 1 in the all-patched model, so
    m(only h) − m(∅) ≈ ∂m/∂m_h at the all-patched masks. The linearisation is Nanda's
    attribution patching (2023), shown by Syed, Rager and Conmy ("Attribution Patching
    Outperforms Automated Circuit Discovery", 2023) to rank components as activation patching
    does; a head whose effect is far from linear in its mask is where the two disagree.
    """
    full, necessity = mask_gradient(model, batch, cf, 1.0)
    empty, sufficiency = mask_gradient(model, batch, cf, 0.0)
    return HeadEffects(full, empty, necessity.cpu(), sufficiency.cpu(), forward_passes=2)


def head_effects_loop(model: nn.Module, batch: Batch, cf: Counterfactual) -> HeadEffects:
    """The reference: the same quantities with one forward pass per mask (2N + 2 passes)."""
    layout = head_layout(model)
    masks = effect_masks(layout).to(batch["input_ids"].device)
    values = torch.tensor([behaviour(model, batch, m, cf) for m in masks])
    return _effects(values, layout, masks.size(0))
