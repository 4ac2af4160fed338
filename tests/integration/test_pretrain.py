from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console
from safetensors.torch import load_file

from forgetless.config.schema import ModelConfig
from forgetless.models.loading import load_model_and_tokenizer
from forgetless.training.pretrain import base_fingerprint, pretrain_base

SMALL = {
    "tiny": {
        "hidden_size": 32,
        "num_layers": 1,
        "num_heads": 2,
        "num_kv_heads": 1,
        "intermediate_size": 64,
    },
    "pretrain": {"steps": 3, "batch_size": 4, "n_train": 8, "tasks": ["copy", "upper"]},
}


def test_pretrain_is_reproducible_and_loadable(tmp_path: Path) -> None:
    cfg = ModelConfig.model_validate(SMALL)
    report = pretrain_base(cfg, tmp_path / "a", Console(quiet=True), progress=False)
    pretrain_base(cfg, tmp_path / "b", Console(quiet=True), progress=False)
    a = load_file(str(tmp_path / "a" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert set(report["accuracy"]) == {"copy", "upper"}
    model, tokenizer = load_model_and_tokenizer(cfg, str(tmp_path / "a"))
    assert (
        tokenizer.decode(tokenizer("cp a b=", add_special_tokens=False)["input_ids"]) == "cp a b="
    )
    assert model.config.hidden_size == 32


def test_fingerprint_follows_the_config() -> None:
    cfg = ModelConfig.model_validate(SMALL)
    other = ModelConfig.model_validate({**SMALL, "pretrain": {**SMALL["pretrain"], "seed": 1}})
    assert base_fingerprint(cfg) != base_fingerprint(other)
    assert base_fingerprint(cfg) == base_fingerprint(ModelConfig.model_validate(SMALL))
