from __future__ import annotations

from pathlib import Path

from forgetless.config.schema import ModelConfig
from forgetless.models.loading import load_tokenizer
from forgetless.tasks.base import Example
from forgetless.tasks.formatting import IGNORE_INDEX, collate, encode_example, encode_prompt


def test_completion_only_labels_plain(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_model_dir), ModelConfig())
    feats = encode_example(tok, Example("rev ab=", "ba"), max_length=32)
    n_prompt = len("rev ab=")
    assert feats["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert feats["labels"][n_prompt:] == feats["input_ids"][n_prompt:]
    assert tok.decode(feats["input_ids"][n_prompt:], skip_special_tokens=True) == "ba"
    assert feats["input_ids"][-1] == tok.eos_token_id


def test_tokenizer_round_trips_spaces_after_reload(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_model_dir), ModelConfig())
    ids = tok("cp a b=", add_special_tokens=False)["input_ids"]
    assert len(ids) == len("cp a b=")
    assert tok.decode(ids) == "cp a b="


def test_chat_template_is_applied(tiny_llama_chat_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_llama_chat_dir), ModelConfig())
    example = Example("hi", "yo")
    prompt = encode_prompt(tok, example)
    assert tok.decode(prompt) == "<user>hi<assistant>"
    feats = encode_example(tok, example, max_length=64)
    answer = [
        t
        for t, label in zip(feats["input_ids"], feats["labels"], strict=True)
        if label != IGNORE_INDEX
    ]
    assert tok.decode(answer, skip_special_tokens=True) == "yo"
    assert answer[-1] == tok.eos_token_id


def test_collate_right_pads() -> None:
    batch = collate(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [5], "labels": [5]}],
        pad_id=0,
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [5, -100, -100]]


def test_collate_passes_example_index_through() -> None:
    feats = [
        {"input_ids": [5], "labels": [5], "index": [3]},
        {"input_ids": [6], "labels": [6], "index": [0]},
    ]
    assert collate(feats, pad_id=0)["index"].tolist() == [3, 0]
