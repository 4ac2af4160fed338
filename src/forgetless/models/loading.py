"""Loading causal LMs and tokenizers from the hub or a local folder, with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from forgetless.config.schema import ModelConfig
from forgetless.core.dtypes import DTYPES
from forgetless.errors import ModelLoadError
from forgetless.models.gguf import converted_model_dir


def _looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def resolve_source(name: str, announce: Any = None) -> str:
    """A local folder (which must exist and hold a config), the cached conversion of a packaged
    model or a ``.gguf`` file (``forgetless.models.gguf``), or a hub id, left as it is."""
    converted = converted_model_dir(name, announce)
    if converted is not None:
        return str(converted)
    if not _looks_local(name):
        return name
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model.name_or_path: no such folder: {path}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model.name_or_path: {path} has no config.json")
    return str(path)


GENERIC_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def _declares_generic_tokenizer(source: str) -> bool:
    """True when a local folder's tokenizer_config names the generic fast tokenizer.

    AutoTokenizer would otherwise pick the model type's own class (e.g. Qwen2Tokenizer), whose
    byte-level pipeline silently changes a custom tokenizer's output.
    """
    config = Path(source) / "tokenizer_config.json"
    if not config.is_file():
        return False
    return (
        json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class") in GENERIC_TOKENIZERS
    )


def load_tokenizer(source: str, cfg: ModelConfig) -> Any:
    loader: Any = PreTrainedTokenizerFast if _declares_generic_tokenizer(source) else AutoTokenizer
    try:
        tokenizer = loader.from_pretrained(
            source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"model.name_or_path: cannot load tokenizer from {source!r}: {_first_line(err)}"
        ) from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ModelLoadError(
                f"model.name_or_path: the tokenizer of {source!r} has neither a pad nor an eos "
                "token; add a pad_token to its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out, so any id will do
    return tokenizer


def load_model(source: str, cfg: ModelConfig) -> PreTrainedModel:
    hf_logging.disable_progress_bar()  # forgetless draws its own bars
    kwargs: dict[str, Any] = {
        "dtype": DTYPES[cfg.dtype],
        "revision": cfg.revision,
        "trust_remote_code": cfg.trust_remote_code,
        "use_safetensors": True,  # never unpickle weights (pytorch_model.bin can run code)
    }
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"model.name_or_path: cannot load model from {source!r}: {_first_line(err)}"
        ) from None
    model.eval()
    return model


def load_model_and_tokenizer(
    cfg: ModelConfig, source: str | None = None
) -> tuple[PreTrainedModel, Any]:
    """Load from ``source`` (default ``cfg.name_or_path``); the caller resolves the tiny default."""
    source = resolve_source(source or cfg.name_or_path or "")
    return load_model(source, cfg), load_tokenizer(source, cfg)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
