"""Examples to token ids: the chat template when there is one, completion-only labels."""

from __future__ import annotations

from typing import Any

import torch

from forgetless.errors import DataError
from forgetless.tasks.base import Example

Features = dict[str, list[int]]
IGNORE_INDEX = -100


def _chat_messages(example: Example) -> list[dict[str, str]]:
    if example.messages is not None:
        return [dict(m) for m in example.messages]
    return [
        {"role": "user", "content": example.prompt},
        {"role": "assistant", "content": example.completion},
    ]


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=True
    )
    return list(out["input_ids"])


def encode_prompt(tokenizer: Any, example: Example) -> list[int]:
    """The ids the model is given at evaluation time (ends with the generation prompt)."""
    if getattr(tokenizer, "chat_template", None):
        return _chat_ids(tokenizer, _chat_messages(example)[:-1], generation_prompt=True)
    return _ids(tokenizer, example.prompt)


def _prompt_and_completion(tokenizer: Any, example: Example) -> tuple[list[int], list[int]]:
    prompt = encode_prompt(tokenizer, example)
    if getattr(tokenizer, "chat_template", None):
        full = _chat_ids(tokenizer, _chat_messages(example), generation_prompt=False)
        if full[: len(prompt)] != prompt:
            raise ValueError("the chat template renders the prompt differently with the answer")
        return prompt, full[len(prompt) :]
    return prompt, [*_ids(tokenizer, example.completion), tokenizer.eos_token_id]


def encoded_length(tokenizer: Any, example: Example) -> int:
    """The tokens ``example`` takes as trained, prompt and completion, before any truncation."""
    prompt, completion = _prompt_and_completion(tokenizer, example)
    return len(prompt) + len(completion)


def _truncate(prompt: list[int], completion: list[int], max_length: int) -> Features:
    ids = (prompt + completion)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt) + completion)[:max_length]
    return {"input_ids": ids, "labels": labels}


def encode_example(tokenizer: Any, example: Example, max_length: int) -> Features:
    """Prompt + completion ids with labels masked to -100 on the prompt (completion-only loss).

    With a chat template, the completion is whatever the template appends for the assistant turn
    (its end-of-turn marker included); otherwise it is the completion text plus EOS. Longer than
    ``max_length``, the sequence keeps its first ``max_length`` tokens (the tail goes).
    """
    return _truncate(*_prompt_and_completion(tokenizer, example), max_length)


def encode_training_set(
    tokenizer: Any, examples: list[Example], max_length: int, where: str
) -> tuple[list[Features], int]:
    """Encode a task's training examples; return them and how many were truncated.

    The truncation policy (docs/reliability.md): an example longer than ``max_length`` keeps its
    first ``max_length`` tokens, so the end of its completion is cut and counted; an example
    whose prompt alone fills ``max_length`` would train on no token at all, and is a DataError
    naming ``where`` and the example's index.
    """
    features, truncated = [], 0
    for index, example in enumerate(examples):
        prompt, completion = _prompt_and_completion(tokenizer, example)
        if len(prompt) >= max_length:
            raise DataError(
                f"{where} example {index}: the prompt is {len(prompt)} tokens, so "
                f"train.max_length={max_length} leaves none of the completion; raise "
                "train.max_length or shorten the prompt"
            )
        truncated += len(prompt) + len(completion) > max_length
        features.append(_truncate(prompt, completion, max_length))
    return features, truncated


def unknown_token_examples(tokenizer: Any, features: list[Features]) -> int:
    """How many encoded examples hold the tokenizer's unknown token (text it cannot spell, such
    as non-ASCII characters for the built-in character tokenizer)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return 0
    return sum(unk in f["input_ids"] for f in features)


def collate(features: list[Features], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad features into input_ids / attention_mask / labels tensors.

    An ``index`` key (an example's position in its dataset, as one-element list) passes through
    as a tensor, so a loss can look up per-example targets cached ahead of training.
    """
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), width), pad_id, dtype=torch.long)
    labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(features), width), dtype=torch.long)
    for row, feat in enumerate(features):
        n = len(feat["input_ids"])
        ids[row, :n] = torch.tensor(feat["input_ids"])
        labels[row, :n] = torch.tensor(feat["labels"])
        mask[row, :n] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if all("index" in f for f in features):
        batch["index"] = torch.tensor([f["index"][0] for f in features], dtype=torch.long)
    return batch


def completion_window(labels: torch.Tensor) -> int:
    """How many trailing positions hold every labelled token and the one before each row's
    first label: what ``logits_to_keep`` needs for a shifted loss (right-padded batches).
    Skipping the prompt's logits spares most of a large vocabulary's output layer."""
    labelled = labels != IGNORE_INDEX
    if not bool(labelled.any()):
        return labels.shape[1]
    first = int(labelled.float().argmax(dim=1)[labelled.any(dim=1)].min())
    return labels.shape[1] - max(first - 1, 0)
