"""Block expansion (LLaMA Pro): new decoder blocks learn the tasks; the original ones stay frozen.

At the first task's start the stack of ``L`` decoder blocks is split into ``N`` equal groups and
a copy of each group's top block is inserted right above it, its output projections (attention
``o_proj``, MLP ``down_proj``) zeroed: every new block adds nothing to the residual stream, so
the expanded model computes exactly what the base did. Only the new blocks train, for the whole
sequence; embeddings, final norm, head and every original block keep the base's weights.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from forgetless.contract.hooks import TaskContext
from forgetless.contract.method import Capability, Method, MethodConfig, declare_method
from forgetless.core import registry
from forgetless.core.fields import Count
from forgetless.errors import ConfigError
from forgetless.methods.papers import cite

ZEROED = ("o_proj", "down_proj")
"""The projections that write a block's attention and MLP outputs into the residual stream."""
NEW_BLOCK = "forgetless_new_block"
"""Attribute set on every inserted block: how an expanded model is recognised (once per run)."""
GROUP_SIZE = 4
"""The paper's ratio: LLaMA-2-7B's 32 blocks grow to 40, one new block per group of 4."""

# --- the math ---------------------------------------------------------------------------------


def valid_counts(num_layers: int) -> list[int]:
    """The numbers of new blocks that split ``num_layers`` into equal groups (its divisors)."""
    return [n for n in range(1, num_layers + 1) if num_layers % n == 0]


def default_new_blocks(num_layers: int) -> int:
    """The most new blocks whose groups hold at least ``GROUP_SIZE`` layers each (8 for 32
    layers, as in the paper; 6 for 30; 1 for 4 or fewer)."""
    return max(n for n in valid_counts(num_layers) if n == 1 or num_layers // n >= GROUP_SIZE)


def expansion_sources(num_layers: int, num_new: int) -> list[int]:
    """The block each new block copies and follows: the top block of each of ``num_new`` equal
    groups (LLaMA-Factory's ``scripts/llama_pro.py`` places them alike)."""
    if num_new < 1 or num_layers % num_new:
        counts = ", ".join(map(str, valid_counts(num_layers)))
        raise ValueError(
            f"num_new_blocks={num_new} must divide the model's {num_layers} decoder layers into "
            f"equal groups (one of {counts})"
        )
    group = num_layers // num_new
    return [start + group - 1 for start in range(0, num_layers, group)]


# --- the model surgery --------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder blocks (``model.layers`` in Llama, Qwen2 and Mistral)."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    found = [
        module
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"
    ]
    if count is None or len(found) != 1 or len(found[0]) != count:
        raise ValueError(
            f"{type(model).__name__} has no list of decoder blocks named 'layers' matching its "
            "config.num_hidden_layers"
        )
    return found[0]


def identity_copy(block: nn.Module, config: Any) -> nn.Module:
    """A copy of ``block`` whose output projections are zero: it leaves its input unchanged.
    The copy shares the model's config object, as the original blocks do."""
    new = copy.deepcopy(block, memo={id(config): config})
    zeroed = {name: module for name, module in new.named_modules() if name.endswith(ZEROED)}
    missing = [p for p in ZEROED if not any(n.endswith(p) for n in zeroed)]
    if missing:
        raise ValueError(
            f"{type(block).__name__} has no {' or '.join(missing)}: block expansion needs "
            "Llama-style blocks (Llama, Qwen2, Mistral)"
        )
    with torch.no_grad():
        for module in zeroed.values():
            for param in module.parameters():
                param.zero_()
    setattr(new, NEW_BLOCK, True)
    return new


def _renumber(layers: nn.ModuleList) -> None:
    """Every ``layer_idx`` is the block's new position: the KV cache is indexed by it."""
    for index, block in enumerate(layers):
        for module in block.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                setattr(module, "layer_idx", index)  # noqa: B010 (nn.Module types it as a tensor)


def expand_blocks(model: nn.Module, num_new: int | None = None) -> list[int]:
    """Insert ``num_new`` identity blocks in ``model``, in place (LLaMA Pro's block expansion).

    ``num_new`` defaults to ``default_new_blocks``. The model config's ``num_hidden_layers``
    (and ``layer_types`` where it exists) follow, so generation with a KV cache and
    ``save_pretrained`` / ``from_pretrained`` see the expanded stack. Returns the new blocks'
    indices; raises ValueError for a count that does not divide the stack or an unknown block.
    """
    config: Any = model.config
    layers = decoder_layers(model)
    num_layers = len(layers)
    sources = expansion_sources(num_layers, num_new or default_new_blocks(num_layers))
    for source in reversed(sources):  # from the top: the sources below keep their positions
        layers.insert(source + 1, identity_copy(layers[source], config))
    _renumber(layers)
    config.num_hidden_layers = len(layers)
    types = getattr(config, "layer_types", None)
    if types is not None:
        config.layer_types = [t for i, t in enumerate(types) for _ in range(1 + (i in sources))]
    return new_block_indices(model)


def new_block_indices(model: nn.Module) -> list[int]:
    """The positions of the blocks ``expand_blocks`` inserted (empty: not expanded)."""
    return [i for i, block in enumerate(decoder_layers(model)) if getattr(block, NEW_BLOCK, False)]


def train_only_new_blocks(model: nn.Module) -> None:
    """Every parameter of the new blocks trains; every other one is frozen."""
    for param in model.parameters():
        param.requires_grad = False
    for index in new_block_indices(model):
        for param in decoder_layers(model)[index].parameters():
            param.requires_grad = True


# --- the method ---------------------------------------------------------------------------------


class BlockExpansionConfig(MethodConfig):
    name: Literal["block_expansion"] = "block_expansion"
    """LLaMA Pro block expansion (train new identity blocks)."""
    num_new_blocks: Count | None = None
    """Decoder blocks to insert, one above each of as many equal groups; must divide the model's
    layer count. None: one per group of at least 4 layers, the paper's ratio (LLaMA-2-7B's 32
    blocks + 8, LLaMA-Factory's example --num_expand 8)."""


@declare_method(
    BlockExpansionConfig,
    capabilities={Capability.MODEL_SETUP, Capability.TASK_START},
    paper=cite("wu2024"),
)
class BlockExpansion(Method[BlockExpansionConfig]):
    """LLaMA Pro's block expansion (Wu et al., 2024, arXiv:2401.02415).

    The base's ``L`` blocks form ``N`` equal groups; above each group's top block goes a copy of
    it whose attention output and MLP down projections are zero, so the expanded model starts as
    the base (the paper's identity initialisation). The expansion happens once, as the model
    loads (``setup_model``: before a resumed run, ``export`` or a diagnosis restores saved
    weights into it), or at the first task's start inside a user's trainer; at every task's
    start all weights but the new blocks' are frozen, so the original blocks, embeddings and
    head keep the base's values for the whole sequence.
    """

    smoke: ClassVar[dict[str, Any]] = {"num_new_blocks": 1}
    full_only = "trains whole new decoder blocks, which LoRA adapters do not reach"
    unsharded = "inserts decoder blocks at the first task's start, after FSDP2 has split the model"

    def __init__(self, config: BlockExpansionConfig) -> None:
        super().__init__(config)

    def setup_model(self, model: nn.Module) -> None:
        try:
            if not new_block_indices(model):
                expand_blocks(model, self.config.num_new_blocks)
        except ValueError as err:
            raise ConfigError(f"method 'block_expansion': {err}") from None

    def on_task_start(self, ctx: TaskContext) -> None:
        refused = registry.lora_rule_broken(self, ctx.run.finetune_mode, "carry")
        if refused:  # a trainer's PEFT model, which no config validated
            raise ConfigError(refused)
        self.setup_model(ctx.model)  # a no-op once expanded (a trainer's model meets it here)
        train_only_new_blocks(ctx.model)
