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
from forgetless.core import hub
from forgetless.core.dtypes import DTYPES
from forgetless.errors import ModelLoadError
from forgetless.models.gguf import converted_model_dir
from forgetless.models.quantized import prepare_quantized, quantized_load_kwargs


def looks_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def resolve_source(name: str, announce: Any = None) -> str:
    """A local folder (which must exist and hold a config), the cached conversion of a packaged
    model or a ``.gguf`` file (``forgetless.models.gguf``), or a hub id, left as it is."""
    converted = converted_model_dir(name, announce)
    if converted is not None:
        return str(converted)
    if not looks_local(name):
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


VOCABULARY_FILES = (
    "tokenizer.json",
    "vocab.json",
    "vocab.txt",
    "tekken.json",
    "*.model",
    "*.tiktoken",
)
"""A tokenizer's vocabulary, one of which a model folder must hold; ``tokenizer_config.json`` and
``special_tokens_map.json`` alone make a tokenizer that spells nothing."""


def _no_tokenizer(source: str, why: str) -> ModelLoadError:
    return ModelLoadError(
        f"model.name_or_path: {source} {why} (none of {', '.join(VOCABULARY_FILES)}); copy the "
        "tokenizer files of the model it was fine-tuned from (e.g. tokenizer.json and "
        "tokenizer_config.json) into the folder beside its weights"
    )


def check_tokenizer_files(source: str, cfg: ModelConfig) -> None:
    """Refuse a local folder without a tokenizer's vocabulary: transformers would build an empty
    tokenizer from the model's config instead of failing (code shipped with a model may name
    files of its own, so ``trust_remote_code`` skips the check; ``load_tokenizer`` checks the
    tokenizer itself)."""
    path = Path(source)
    if not path.is_dir() or cfg.trust_remote_code:
        return
    if not any(next(path.glob(pattern), None) for pattern in VOCABULARY_FILES):
        raise _no_tokenizer(str(path), "has no tokenizer files")


def _check_spells(tokenizer: Any, source: str) -> None:
    """An empty tokenizer (its files missing on the hub, or not found by remote code) turns
    every text into nothing but special tokens."""
    ids = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    if not set(ids) - set(tokenizer.all_special_ids):
        raise _no_tokenizer(source, "has a tokenizer that spells no text: its files are missing")


ROUND_TRIP = "ab cd ef"
"""Words and spaces every tokenizer of a language model spells back unchanged."""


def lost_text_warning(tokenizer: Any) -> str | None:
    """One line when ``tokenizer`` does not give back ``ROUND_TRIP`` after encoding it: a
    tokenizer loaded as another class than its folder declares (transformers 5's AutoTokenizer
    picks Qwen2Tokenizer for a qwen2 model whose folder declares the generic fast tokenizer)
    drops characters, and a run on it learns from text it never sees."""
    ids = tokenizer(ROUND_TRIP, add_special_tokens=False)["input_ids"]
    back = tokenizer.decode(ids, skip_special_tokens=True)
    if back == ROUND_TRIP:
        return None
    return (
        f"the tokenizer ({type(tokenizer).__name__}) gives {ROUND_TRIP!r} back as "
        f"{back!r}; if its folder's tokenizer_config.json names TokenizersBackend or "
        "PreTrainedTokenizerFast, load it with PreTrainedTokenizerFast.from_pretrained(folder)"
    )


def cache_only(source: str, cfg: ModelConfig) -> bool:
    """Whether the hub id ``source`` must be read from the cache alone (offline, or the hub out
    of reach); one that is not cached then is refused at once (``forgetless.core.hub``)."""
    if Path(source).expanduser().exists():
        return False
    why = hub.why_unreachable()
    if why is None:
        return False
    if not hub.model_cached(source, cfg.revision):
        raise ModelLoadError(hub.not_cached(f"model.name_or_path: {source!r}", why))
    return True


def load_tokenizer(source: str, cfg: ModelConfig) -> Any:
    check_tokenizer_files(source, cfg)
    loader: Any = PreTrainedTokenizerFast if _declares_generic_tokenizer(source) else AutoTokenizer
    try:
        tokenizer = loader.from_pretrained(
            source,
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
            local_files_only=cache_only(source, cfg),
        )
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"model.name_or_path: cannot load tokenizer from {source!r}: {_first_line(err)}"
        ) from None
    _check_spells(tokenizer, source)
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
        "local_files_only": cache_only(source, cfg),
    }
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    kwargs.update(quantized_load_kwargs(cfg))
    try:
        model = _from_pretrained(source, kwargs)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"model.name_or_path: cannot load model from {source!r}: {_first_line(err)}"
        ) from None
    if cfg.quantization is not None:
        model = prepare_quantized(model)
    model.eval()
    return model


SDPA_REFUSED = "scaled_dot_product_attention"
"""What transformers' refusal of sdpa for a model without that kernel says."""


def _from_pretrained(source: str, kwargs: dict[str, Any]) -> PreTrainedModel:
    """The model, with eager attention where sdpa was asked for and the model has none (the
    start-up lines say so: ``attention_note``)."""
    try:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except ValueError as err:
        if kwargs.get("attn_implementation") != "sdpa" or SDPA_REFUSED not in str(err):
            raise
    return AutoModelForCausalLM.from_pretrained(
        source, **{**kwargs, "attn_implementation": "eager"}
    )


def attention_in_use(model: Any) -> str | None:
    """The attention implementation ``model`` runs (None: not a transformers model)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def attention_note(cfg: ModelConfig, model: Any) -> str | None:
    """A note when the model runs another attention than the one asked for."""
    used, wanted = attention_in_use(model), cfg.attn_implementation
    if wanted is None or used is None or used == wanted:
        return None
    return (
        f"note: {type(model).__name__} has no {wanted} attention; it runs {used} "
        "(model.attn_implementation)"
    )


def load_model_and_tokenizer(
    cfg: ModelConfig, source: str | None = None
) -> tuple[PreTrainedModel, Any]:
    """Load from ``source`` (default ``cfg.name_or_path``); the caller resolves the tiny default."""
    source = resolve_source(source or cfg.name_or_path or "")
    check_tokenizer_files(source, cfg)  # before a model that may take minutes to load
    return load_model(source, cfg), load_tokenizer(source, cfg)


POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")
"""Where a model's config keeps its longest sequence, by architecture family."""


def model_positions(model: Any) -> int | None:
    """The longest sequence ``model`` takes in tokens, from its config (None: not declared)."""
    config = getattr(model, "config", None)
    for name in POSITION_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
