"""O-LoRA: each task's LoRA adapter learns in a subspace orthogonal to the past tasks' adapters.

Runs in the ``per_task`` LoRA regime: task ``t`` trains a fresh adapter ``task_<t>`` while the
adapters of earlier tasks stay active and frozen. A loss term pushes the rows of the new adapter's
down-projections ``A`` to be orthogonal to those of every past adapter at the same layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

from forgetless.contract.hooks import StepContext, TaskContext
from forgetless.contract.method import Capability, Method, MethodConfig, declare_method
from forgetless.core import distributed, sharding
from forgetless.core.fields import NonNegative
from forgetless.methods.papers import cite

# --- the math ---------------------------------------------------------------------------------


def orthogonality_loss(a_new: list[Tensor], a_past: list[list[Tensor]]) -> Tensor:
    """Sum over past tasks and LoRA layers of the squared entries of ``A_new @ A_past.T``.

    ``a_new[l]`` is the new adapter's ``A`` (rank x in_features) at layer ``l``; ``a_past[t][l]``
    is past task ``t``'s ``A`` at the same layer. Zero exactly when every row of each new ``A`` is
    orthogonal to every row of the past ones (the paper's L_orth, summed over tasks and layers).
    """
    if not a_new:
        raise ValueError("orthogonality_loss needs at least one LoRA layer")
    total = a_new[0].new_zeros((), dtype=torch.float32)
    for past in a_past:
        if len(past) != len(a_new):
            raise ValueError(f"a past adapter has {len(past)} LoRA layers, the new {len(a_new)}")
        for new, old in zip(a_new, past, strict=True):
            total = total + (new.float() @ old.float().T).pow(2).sum()
    return total


def l2_loss(params: Iterable[Tensor]) -> Tensor:
    """Squared L2 norm of all ``params`` together (sum of squared entries)."""
    parts = [p.float().pow(2).sum() for p in params]
    if not parts:
        raise ValueError("l2_loss needs at least one parameter")
    return torch.stack(parts).sum()


# --- finding the adapters -----------------------------------------------------------------------


def adapter_name(task_index: int) -> str:
    """The ``per_task`` regime's adapter for a 1-based task index (see ``models/finetuner.py``)."""
    return f"task_{task_index}"


def lora_a_matrices(model: nn.Module, adapters: list[str]) -> dict[str, list[Tensor]]:
    """Each adapter's ``A`` weights, one per PEFT LoRA layer, in the same (module) order."""
    found: dict[str, list[Tensor]] = {name: [] for name in adapters}
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for name in adapters:
            if name not in module.lora_A:
                raise ValueError(f"o_lora: a LoRA layer has no adapter {name!r}")
            weight = module.lora_A[name].weight
            assert isinstance(weight, Tensor)
            found[name].append(weight)
    return found


# --- the method ---------------------------------------------------------------------------------


class OLoRAConfig(MethodConfig):
    name: Literal["o_lora"] = "o_lora"
    """Orthogonal-subspace LoRA (O-LoRA)."""
    lambda_orth: NonNegative = 0.5
    """Weight λ1 of the orthogonality loss between the new adapter's A and the past adapters' A (0.5
    in the authors' scripts for T5 and LLaMA)."""
    lambda_l2: NonNegative = 0.0
    """Weight λ2 of the squared L2 norm of the new adapter's A and B (0 in the authors' scripts)."""


@declare_method(
    OLoRAConfig, capabilities={Capability.TASK_START, Capability.LOSS_TERMS}, paper=cite("wang2023")
)
class OLoRA(Method[OLoRAConfig]):
    """Orthogonal subspace learning for continual learning (Wang et al., 2023).

    X. Wang, T. Chen, Q. Ge, H. Xia, R. Bao, R. Zheng, Q. Zhang, T. Gui, X. Huang, "Orthogonal
    Subspace Learning for Language Model Continual Learning", Findings of EMNLP 2023,
    arXiv:2310.14152. The loss adds ``λ1 · Σ_past Σ_layers ‖A_new A_pastᵀ‖²`` (squared entries,
    as in the paper's L_orth) and ``λ2 · ‖θ_new‖²`` over the new adapter's parameters. Defaults
    follow the authors' scripts (github.com/cmnfriend/O-LoRA: ``lamda_1 0.5``, ``lamda_2 0``).
    Their trainer sums absolute rather than squared entries and uses an unsquared norm for the
    L2 term; this follows the paper's equations. Past adapters stay active at evaluation, so the
    evaluated model is the sum of all task adapters, as in the paper.
    """

    window_ok = True  # its penalty reads the adapters, never the logits
    lora_regimes = ("per_task",)
    unsharded = None  # adapters attached before the split; A gathered whole for the loss

    def __init__(self, config: OLoRAConfig) -> None:
        super().__init__(config)
        self._new: list[Tensor] = []
        self._past: list[list[Tensor]] = []
        self._new_params: list[Tensor] = []

    def on_task_start(self, ctx: TaskContext) -> None:
        """Collect the current adapter's parameters and the frozen past adapters' ``A``."""
        current = adapter_name(ctx.task_index)
        past = [adapter_name(i) for i in range(1, ctx.task_index)]
        matrices = lora_a_matrices(ctx.model, [current, *past])
        if not matrices[current]:
            raise ValueError(
                f"o_lora: the model has no LoRA layer with adapter {current!r} "
                "(needs finetune.mode lora, regime per_task)"
            )
        self._new = matrices[current]
        # the past adapters are frozen: stacked once per layer (made whole on a sharded model),
        # the loss is one product per layer whatever the number of past tasks
        # (Σ_t ‖A Aₜᵀ‖² = ‖A [A_1; …; A_t]ᵀ‖²)
        layers = zip(*(matrices[name] for name in past), strict=True)
        stacked = [torch.cat([sharding.replicated(a.detach()) for a in layer]) for layer in layers]
        self._past = [stacked] if past else []
        self._new_params = [
            p for n, p in ctx.model.named_parameters() if f".{current}." in n and "lora_" in n
        ]

    def loss_terms(self, batch: Any, outputs: Any, ctx: StepContext) -> dict[str, Tensor]:
        if not self._new:
            raise RuntimeError("o_lora: loss_terms called before on_task_start")
        # on a sharded model each A is gathered whole (gradients flow back to the shards), and
        # the terms, which read parameters only, skip FSDP's averaging (parameter_term)
        new = [sharding.replicated(a) for a in self._new]
        orthogonality = self.config.lambda_orth * orthogonality_loss(new, self._past)
        if self.config.lambda_l2 == 0:  # the default: no gathers for a term that is zero
            l2 = orthogonality.new_zeros(())
        else:
            l2 = self.config.lambda_l2 * l2_loss([sharding.replicated(p) for p in self._new_params])
        terms = {"orthogonality": orthogonality, "l2": l2}
        return {k: distributed.parameter_term(v, ctx.batch_share) for k, v in terms.items()}
