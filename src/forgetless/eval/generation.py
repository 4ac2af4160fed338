"""Scoring by greedy generation, and teacher-forced log-probs for output-space drift."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from forgetless.eval.metrics import token_kl
from forgetless.eval.prompt_batch import prompt_batch, returned_cache
from forgetless.tasks.base import Example, Task
from forgetless.tasks.formatting import (
    IGNORE_INDEX,
    collate,
    completion_window,
    encode_example,
    encode_prompt,
)


@dataclass
class EvalResult:
    """Accuracy of one task plus, per eval example, whether it was answered correctly.

    ``metrics`` holds a scorer's extra numbers (``acc`` and ``acc_norm`` for multiple choice,
    ``unparsed`` for generation checks); exact match leaves it empty.
    """

    task: str
    accuracy: float
    correct: list[bool]
    predictions: list[str]
    metrics: dict[str, float] = field(default_factory=dict)


def generate_completions(
    model: nn.Module, tokenizer: Any, examples: list[Example], max_new_tokens: int, batch_size: int
) -> list[str]:
    """Greedy completions, batched with left padding; decoding stops at EOS."""
    ids = generate_token_ids(model, tokenizer, examples, max_new_tokens, batch_size)
    return list(tokenizer.batch_decode(ids, skip_special_tokens=True))


@torch.no_grad()
def generate_token_ids(
    model: nn.Module, tokenizer: Any, examples: list[Example], max_new_tokens: int, batch_size: int
) -> list[list[int]]:
    """The new token ids of greedy generations (special tokens kept), batched with left padding;
    the prompts' shared head runs once per batch (``forgetless.eval.prompt_batch``)."""
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    keyword = cache_keyword(model)
    outputs: list[list[int]] = []
    for start in range(0, len(examples), batch_size):
        chunk = [encode_prompt(tokenizer, e) for e in examples[start : start + batch_size]]
        batch = prompt_batch(model, chunk, pad_id)
        generated = model.generate(  # type: ignore[operator]
            input_ids=batch.ids,
            attention_mask=batch.mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=tokenizer.eos_token_id,
            **batch.cache_kwargs(keyword),
        )
        outputs.extend(generated[:, batch.ids.shape[1] :].tolist())
    return outputs


def evaluate_task(model: nn.Module, tokenizer: Any, task: Task, batch_size: int) -> EvalResult:
    was_training = model.training
    model.eval()
    predictions = generate_completions(model, tokenizer, task.eval, task.max_new_tokens, batch_size)
    model.train(was_training)
    correct = [task.scorer(p, e.completion) for p, e in zip(predictions, task.eval, strict=True)]
    return EvalResult(task.name, sum(correct) / len(correct), correct, predictions)


@torch.no_grad()
def completion_logprobs(
    model: nn.Module, tokenizer: Any, examples: list[Example], max_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-softmax over the vocabulary at each completion position (teacher-forced).

    Returns ``(logp, mask)`` with ``logp`` of shape (batch, positions, vocab) aligned to predict
    the next token, and ``mask`` selecting the completion positions.
    """
    return forced_logprobs(model, teacher_forced_inputs(tokenizer, examples, max_length))


def teacher_forced_inputs(
    tokenizer: Any, examples: list[Example], max_length: int
) -> dict[str, torch.Tensor]:
    """Prompt + gold completion of each example, encoded and padded into one batch (with its
    labels): what the teacher-forced measures take, so a batch scored often is encoded once."""
    feats = [encode_example(tokenizer, e, max_length) for e in examples]
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    return collate(feats, pad_id)


@torch.no_grad()
def forced_logprobs(
    model: nn.Module, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``completion_logprobs`` of a batch from ``teacher_forced_inputs``."""
    logits, labels = teacher_forced_logits(model, inputs)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.cpu(), (labels[:, 1:] != IGNORE_INDEX).cpu()


def teacher_forced_logits(
    model: nn.Module, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of prompt + gold completion in one batch (eval mode), and the labels, both
    over the trailing positions that hold every completion (``completion_window``): the prompt's
    logits, most of a large vocabulary's output layer, are never computed. The tokens every row
    starts with (a task's instruction, a chat template's system turn) run once, for one row,
    and the rows continue from copies of that key/value cache."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in inputs.items()}
    was_training = model.training
    if was_training:
        model.eval()
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    keep = completion_window(labels)
    shared = shared_prefix(ids, mask, limit=ids.shape[1] - keep)
    extra: dict[str, Any] = {"use_cache": False}  # no cache to fill
    if shared > 0 and ids.shape[0] > 1:
        prefix = model(input_ids=ids[:1, :shared], attention_mask=mask[:1, :shared], use_cache=True)
        cache = returned_cache(prefix)
        cache.batch_repeat_interleave(ids.shape[0])
        extra = {"use_cache": True, cache_keyword(model): cache}
        ids = ids[:, shared:]
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep, **extra).logits
    if was_training:
        model.train()
    return logits, labels[:, -logits.shape[1] :]


def shared_prefix(ids: torch.Tensor, mask: torch.Tensor, limit: int) -> int:
    """How many leading tokens every row of a right-padded batch holds alike, at most
    ``limit`` (the positions before the first one whose logits are asked for)."""
    head = ((ids == ids[:1]).all(dim=0) & mask.bool().all(dim=0))[:limit]
    differs = (~head).nonzero()
    return int(differs[0]) if len(differs) else len(head)


def cache_keyword(model: nn.Module) -> str:
    """``cache`` where the model's forward takes it (transformers 5.x), else the older
    ``past_key_values``."""
    unwrap = getattr(model, "get_base_model", None)
    base = unwrap() if callable(unwrap) else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def kl_drift(
    base: tuple[torch.Tensor, torch.Tensor], now: tuple[torch.Tensor, torch.Tensor]
) -> tuple[float, float]:
    """(KL(p_base ‖ p_model), KL(p_model ‖ p_base)) averaged over completion tokens."""
    (logp_base, mask), (logp_now, _) = base, now
    return float(token_kl(logp_base, logp_now, mask)), float(token_kl(logp_now, logp_base, mask))


@torch.no_grad()
def gold_loglik(
    model: nn.Module, tokenizer: Any, examples: list[Example], max_length: int, batch_size: int
) -> float:
    """Mean log-likelihood of the gold completion, in nats per token (teacher-forced).

    Each example's completion tokens are averaged first, then the examples, so long and short
    answers weigh alike. A continuous retention signal beside accuracy: it moves before an
    answer flips from right to wrong.
    """
    per_example: list[torch.Tensor] = []
    for start in range(0, len(examples), batch_size):
        chunk = teacher_forced_inputs(tokenizer, examples[start : start + batch_size], max_length)
        logits, labels = teacher_forced_logits(model, chunk)
        labels = labels[:, 1:]
        mask = labels != IGNORE_INDEX
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        gold = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        total = (gold * mask).sum(-1)
        per_example.append((total / mask.sum(-1).clamp(min=1)).cpu())
    return float(torch.cat(per_example).mean())


@torch.no_grad()
def teacher_forced_match(
    model: nn.Module, tokenizer: Any, examples: list[Example], max_length: int
) -> list[bool]:
    """Per example, whether the model's argmax is the gold token at every completion position
    (its end-of-turn or EOS included), given the gold prefix: one forward pass for the batch.
    By induction this is greedy decoding producing exactly the gold completion, so it agrees
    with exact match except where the scorer accepts another spelling (surrounding spaces) or
    the gold is longer than the task's ``max_new_tokens``."""
    return forced_match(model, teacher_forced_inputs(tokenizer, examples, max_length))


@torch.no_grad()
def forced_match(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[bool]:
    """``teacher_forced_match`` of a batch from ``teacher_forced_inputs``."""
    logits, labels = teacher_forced_logits(model, inputs)
    labels = labels[:, 1:]
    hit = (logits[:, :-1].argmax(-1) == labels) | (labels == IGNORE_INDEX)
    return [bool(row) for row in hit.all(dim=1).cpu()]
