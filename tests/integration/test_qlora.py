"""QLoRA (``model.quantization``): every method runs on a 4-bit base or is refused in one line at
validate; the load options are QLoRA's; a 4-bit load trains its adapters (CUDA only)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from forgetless.config.schema import ModelConfig, RunConfig
from forgetless.contract.method import registered_methods
from forgetless.errors import ModelLoadError
from forgetless.models import quantized

REFUSED = {
    "sdft": "EMA teacher",
    "rl": "merges the adapters",
    "anchored": "whole copies",
    "attribution_gate": "relevance",
    "block_expansion": "needs finetune.mode full",
}
"""The methods a 4-bit base cannot carry, and a word of why."""


def qlora_run(method: str, mode: str = "lora", regime: str = "carry") -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"quantization": {"bits": 4}},
            "finetune": {"mode": mode, "lora": {"regime": regime}},
            "tasks": ["reverse"],
            "method": method,
        }
    )


def refusal(method: str, **kwargs: Any) -> str:
    with pytest.raises(ValidationError) as info:
        qlora_run(method, **kwargs)
    return str(info.value.errors()[0]["msg"])


@pytest.mark.parametrize("name", sorted(registered_methods()))
def test_each_method_validates_on_a_4bit_base_or_is_refused_in_one_line(name: str) -> None:
    regimes = registered_methods()[name].lora_regimes or ("carry",)
    if name not in REFUSED:
        assert qlora_run(name, regime=regimes[0]).model.quantization is not None
        return
    message = refusal(name, regime=regimes[0])
    assert REFUSED[name] in message and name in message
    assert "\n" not in message


def test_4bit_weights_need_lora_and_no_merge() -> None:
    assert "needs finetune.mode lora" in refusal("seq_ft", mode="full")
    assert "regime merge" in refusal("seq_ft", regime="merge")


def test_the_default_is_qloras_nf4_with_double_quantization_and_bf16_compute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quantized, "bitsandbytes_missing", lambda: None)
    cfg = ModelConfig.model_validate({"quantization": {"bits": 4}})
    kwargs = quantized.quantized_load_kwargs(cfg)
    bnb = kwargs["quantization_config"]
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4"
    assert bnb.bnb_4bit_use_double_quant and bnb.bnb_4bit_compute_dtype == torch.bfloat16
    assert kwargs["dtype"] == torch.bfloat16
    assert quantized.quantized_load_kwargs(ModelConfig()) == {}


def test_a_missing_bitsandbytes_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    cfg = ModelConfig.model_validate({"quantization": {"bits": 4}})
    with pytest.raises(ModelLoadError, match=r"forgetless\[qlora\]"):
        quantized.quantized_load_kwargs(cfg)


CUDA_ONLY = "bitsandbytes' 4-bit layers train on a CUDA GPU; the CPU suite checks validation only"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_ONLY)
@pytest.mark.skipif(quantized.bitsandbytes_missing() is not None, reason="needs the qlora extra")
def test_a_4bit_base_trains_only_its_adapters(tiny_model_dir: Path) -> None:
    from forgetless.config.schema import FinetuneConfig
    from forgetless.models.finetuner import Finetuner
    from forgetless.models.loading import load_model

    cfg = ModelConfig.model_validate(
        {"name_or_path": str(tiny_model_dir), "quantization": {"bits": 4}}
    )
    model = load_model(str(tiny_model_dir), cfg)
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    tuner = Finetuner(model, FinetuneConfig.model_validate({"mode": "lora"}))
    tuner.begin_task(1)
    trained = [n for n, p in tuner.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    ids = torch.randint(4, 90, (2, 16), device="cuda")
    tuner.model.train()
    loss = tuner.model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for n, p in tuner.model.named_parameters() if p.requires_grad)
