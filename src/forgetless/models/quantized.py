"""Loading a base in 4 bits for QLoRA (``model.quantization``): transformers' bitsandbytes
integration, NF4 with double quantization and bfloat16 compute by default (Dettmers et al. 2023,
"QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314). The adapters PEFT attaches
on top stay in floating point and are the only weights that train."""

from __future__ import annotations

import importlib.util
from typing import Any

from forgetless.config.quantization import QuantizationConfig
from forgetless.config.schema import ModelConfig
from forgetless.core.dtypes import DTYPES
from forgetless.errors import ModelLoadError

MISSING = (
    "model.quantization needs bitsandbytes: pip install 'forgetless[qlora]' "
    "(4-bit kernels for CUDA GPUs; its CPU build is slow)"
)


def bitsandbytes_missing() -> str | None:
    """Why a 4-bit load cannot run here (bitsandbytes not installed), or None."""
    return MISSING if importlib.util.find_spec("bitsandbytes") is None else None


def bnb_config(quant: QuantizationConfig) -> Any:
    """transformers' ``BitsAndBytesConfig`` for ``quant``."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant.quant_type,
        bnb_4bit_use_double_quant=quant.double_quant,
        bnb_4bit_compute_dtype=DTYPES[quant.compute_dtype],
    )


def quantized_load_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """``from_pretrained`` options for ``cfg``'s quantization ({} when it has none): the
    bitsandbytes config, and the compute dtype for the layers left unquantized."""
    quant = cfg.quantization
    if quant is None:
        return {}
    missing = bitsandbytes_missing()
    if missing:
        raise ModelLoadError(missing)
    return {"quantization_config": bnb_config(quant), "dtype": DTYPES[quant.compute_dtype]}


def prepare_quantized(model: Any) -> Any:
    """Ready a 4-bit model for adapters: norms and embeddings in float32 for stable training,
    input gradients on so that checkpointed blocks still reach the adapters (PEFT's
    ``prepare_model_for_kbit_training``, without its own checkpointing switch)."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
