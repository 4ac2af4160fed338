"""QLoRA: a 4-bit base model under LoRA adapters (``model.quantization``), and the rule that says
which runs can use it.

Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs" (arXiv:2305.14314): the
frozen base is stored as 4-bit NormalFloat with its block scales quantized again ("double
quantization"), dequantized to the compute dtype on the fly; only the adapters train. Loading
needs the ``qlora`` extra (bitsandbytes); ``forgetless.models.quantized`` builds the load options.
"""

from __future__ import annotations

from typing import Any, Literal

from forgetless.strict import StrictModel


class QuantizationConfig(StrictModel):
    """How the frozen base is stored: bitsandbytes 4-bit, as QLoRA does."""

    bits: Literal[4] = 4
    """Bits per base weight (4: QLoRA)."""
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """4-bit data type: nf4 (NormalFloat, QLoRA's) or fp4."""
    double_quant: bool = True
    """Quantize the block scales too (QLoRA's double quantization)."""
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype the 4-bit weights are dequantized to for each matmul; the layers that stay unquantized
    (embeddings, norms, lm_head) are held in it too."""


def quantized_rule_broken(method: Any, mode: str, regime: str) -> str | None:
    """What a 4-bit base breaks of a run's fine-tuning mode, LoRA regime and ``method``'s
    declared rules (``unquantized``: why the method needs the base's full weights), or None."""
    if mode != "lora":
        return "model.quantization needs finetune.mode lora: 4-bit weights take no gradient"
    if regime == "merge":
        return (
            "model.quantization cannot run finetune.lora.regime merge: an adapter merged into "
            "4-bit weights is rounded away; use regime carry or per_task"
        )
    why = getattr(method, "unquantized", None)
    if why:
        return (
            f"method {getattr(method, 'name', '?')!r} {why}: it does not run on a 4-bit base "
            "(model.quantization)"
        )
    return None
