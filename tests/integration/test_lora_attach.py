"""Attaching a LoRA adapter says nothing a user cannot act on: PEFT's constructor reads an
attribute transformers 5 deprecates, which warned once per LoRA run."""

from __future__ import annotations

import warnings

from conftest import TINY
from peft import PeftModel

from forgetless.config.schema import FinetuneConfig
from forgetless.models.finetuner import Finetuner
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model


def test_attaching_an_adapter_warns_of_nothing() -> None:
    model = build_tiny_model(TINY, vocab_size=len(build_char_tokenizer()), seed=0)
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tuner = Finetuner(model, FinetuneConfig(mode="lora"))  # type: ignore[call-arg]
        tuner.begin_task(1)
    assert isinstance(tuner.model, PeftModel)
    assert [str(w.message) for w in caught] == []
    assert warnings.filters == filters  # the silence was scoped to the call
