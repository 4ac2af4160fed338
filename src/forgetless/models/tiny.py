"""The built-in tiny model: a character-level fast tokenizer and a small Qwen2/Llama."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from forgetless.config.schema import TinyModelConfig

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARSET = [chr(code) for code in range(32, 127)]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, saved and reloaded as a real fast tokenizer.

    A BPE model with no merges splits text into single characters; the ``Fuse`` decoder joins
    them back without inserting spaces.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARSET)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", ignore_merges=True))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        model_max_length=1024,
    )


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """A randomly initialised small causal LM, reproducible under ``seed``."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(seed)
    if cfg.arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    return LlamaForCausalLM(LlamaConfig(**common))
