"""The prompts' shared head runs once per batch, and scoring gives what the plain left-padded
batch gives: greedy tokens alike, choice log-likelihoods to 1e-4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from forgetless.eval.generation import generate_token_ids
from forgetless.eval.prompt_batch import left_pad, prompt_batch, shared_head
from forgetless.eval.scorers import choice_loglikelihoods
from forgetless.tasks.base import Example
from forgetless.tasks.formatting import encode_prompt

QUESTIONS = ["add 12+7=", "add 3+45=", "add 60+1=", "add 9+9="]


def load(model_dir: Path) -> tuple[nn.Module, Any]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


class Lengths:
    """Records the (rows, tokens) of every batch the embedding layer reads."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: list[tuple[int, int]] = []
        embed = model.get_input_embeddings()
        self.handle = embed.register_forward_hook(lambda m, a, o: self.seen.append(a[0].shape))

    def close(self) -> None:
        self.handle.remove()


@pytest.mark.parametrize(
    ("prompts", "expected"),
    [
        ([[1, 2, 3], [1, 2, 4]], 2),
        ([[1, 2], [1, 2, 3]], 1),  # each row keeps a token of its own
        ([[5, 2], [1, 2]], 0),
        ([[1, 2, 3]], 0),  # one row: nothing to share
    ],
)
def test_shared_head(prompts: list[list[int]], expected: int) -> None:
    assert shared_head(prompts) == expected


@torch.no_grad()
def _plain_generation(model: nn.Module, tokenizer: Any, examples: list[Example]) -> list[list[int]]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_pad([encode_prompt(tokenizer, e) for e in examples], pad, torch.device("cpu"))
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
    )
    return out[:, ids.shape[1] :].tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_chat_dir"])
def test_generation_runs_the_head_once_and_decodes_the_same(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    model, tokenizer = load(request.getfixturevalue(fixture))
    examples = [Example(q, "") for q in QUESTIONS]
    head = shared_head([encode_prompt(tokenizer, e) for e in examples])
    assert head >= 3
    lengths = Lengths(model)
    ours = generate_token_ids(model, tokenizer, examples, 6, batch_size=4)
    lengths.close()
    assert lengths.seen[0] == (1, head)  # the head, once, for one row
    assert all(rows == 4 for rows, _ in lengths.seen[1:])
    assert ours == _plain_generation(model, tokenizer, examples)


@torch.no_grad()
def test_choices_run_the_head_once_and_unpadded_and_score_as_one_at_a_time(
    tiny_llama_chat_dir: Path,
) -> None:
    model, tokenizer = load(tiny_llama_chat_dir)
    examples = [Example(q, "", choices=("19", "7", "120"), label=0) for q in QUESTIONS]
    lengths = Lengths(model)
    together = choice_loglikelihoods(model, tokenizer, examples, batch_size=4)
    lengths.close()
    head = shared_head([encode_prompt(tokenizer, e) for e in examples])
    assert lengths.seen[0] == (1, head)
    # then the questions' own tokens; then each choice length's continuations, unpadded
    assert lengths.seen[2:] == [(4, 1), (4, 2)]  # "19" (one more token), "120" (two); "7" none
    alone = [choice_loglikelihoods(model, tokenizer, [e], batch_size=1)[0] for e in examples]
    for a, b in zip(together, alone, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_an_attention_kernel_that_unpads_gets_plain_left_padding(tiny_model_dir: Path) -> None:
    model, tokenizer = load(tiny_model_dir)
    prompts = [encode_prompt(tokenizer, Example(q, "")) for q in QUESTIONS]
    assert prompt_batch(model, prompts, 0).shared >= 3
    model.config._attn_implementation = "flash_attention_2"
    batch = prompt_batch(model, prompts, 0)
    assert batch.shared == 0 and batch.cache is None
