"""Task scorers behind one small interface, chosen per task in the config.

* exact match of a greedy generation (the default,
  :func:`forgetless.eval.generation.evaluate_task`);
* generation checks: ``contains``, ``startswith``, a regex extraction, a numeric answer
  (GSM8K-style ``#### 42``);
* multiple choice by the log-likelihood of each choice given the prompt, with lm-evaluation-
  harness's ``acc`` (raw sum) and ``acc_norm`` (divided by the choice's length in characters:
  ``ConfigurableTask.process_results`` in lm-eval 0.4.13, ``lm_eval/api/task.py``).

Prompts go through :func:`forgetless.tasks.formatting.encode_prompt`, so a tokenizer's chat
template is applied exactly as in training. Output that a scorer cannot parse scores 0 and is
logged with a count and the first offender.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol

import torch
from torch import nn

from forgetless.config.evaluation import (
    AliasScorer,
    ContainsScorer,
    EndsTurnScorer,
    ExactMatchScorer,
    MultipleChoiceScorer,
    NumericScorer,
    RegexScorer,
    ScorerConfig,
    StartsWithScorer,
)
from forgetless.core.modules import evaluating
from forgetless.errors import DataError
from forgetless.eval.generation import (
    EvalResult,
    cache_keyword,
    evaluate_task,
    generate_completions,
    generate_token_ids,
)
from forgetless.eval.prompt_batch import prompt_batch, returned_cache
from forgetless.tasks.base import Example, Task
from forgetless.tasks.formatting import encode_prompt

logger = logging.getLogger(__name__)

Verdict = bool | None
"""A generation check's answer: right, wrong, or None when the generation has no answer."""


class TaskScorer(Protocol):
    """Scores a model on a task's eval split."""

    def score(self, model: nn.Module, tokenizer: Any, task: Task, batch_size: int) -> EvalResult:
        """Accuracy and per-example outcomes of ``model`` on ``task.eval``."""
        ...


# --- answer extraction (pure) --------------------------------------------------------------------

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_FINAL = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY = re.compile(_NUMBER)


def extract_number(text: str, strict: bool = False) -> Decimal | None:
    """The answer number of a text: after the last ``####``, else (unless ``strict``) the last
    number in the text. Understands ``1,234``, ``-5`` and ``3.50``; None when there is none.

    The ``####`` convention is GSM8K's (Cobbe et al., 2021, "Training Verifiers to Solve Math
    Word Problems"); the last-number fallback mirrors lm-eval's "flexible-extract" filter.
    """
    finals = _FINAL.findall(text)
    if finals:
        found = finals[-1]
    elif strict:
        return None
    else:
        numbers = _ANY.findall(text)
        if not numbers:
            return None
        found = numbers[-1]
    try:
        return Decimal(found.replace(",", ""))
    except InvalidOperation:
        return None


def regex_answer(text: str, pattern: str, group: int = 1) -> str | None:
    """Group ``group`` of the first match of ``pattern`` in ``text``, stripped; None if none."""
    match = re.search(pattern, text)
    if match is None or match.group(group) is None:
        return None
    return match.group(group).strip()


def numeric_verdict(prediction: str, reference: str, cfg: NumericScorer) -> Verdict:
    """Whether the prediction's number equals the reference's (within ``cfg.tolerance``)."""
    expected = extract_number(reference, strict=False)
    if expected is None:
        raise DataError(f"numeric scorer: the reference {reference!r} holds no number")
    got = extract_number(prediction, strict=cfg.strict)
    if got is None:
        return None
    return abs(got - expected) <= Decimal(str(cfg.tolerance))


def regex_verdict(prediction: str, reference: str, cfg: RegexScorer) -> Verdict:
    """Whether the regex answer of the prediction equals the reference's answer."""
    got = regex_answer(prediction, cfg.pattern, cfg.group)
    if got is None:
        return None
    expected = regex_answer(reference, cfg.pattern, cfg.group)
    return got == (expected if expected is not None else reference.strip())


def contains_verdict(prediction: str, reference: str) -> Verdict:
    return reference.strip() in prediction


def startswith_verdict(prediction: str, reference: str) -> Verdict:
    return prediction.strip().startswith(reference.strip())


# --- generation scorers --------------------------------------------------------------------------


@dataclass(frozen=True)
class ExactMatch:
    """Today's scoring: greedy generation checked by ``task.scorer`` (exact match by default)."""

    def score(self, model: nn.Module, tokenizer: Any, task: Task, batch_size: int) -> EvalResult:
        return evaluate_task(model, tokenizer, task, batch_size)


@dataclass(frozen=True)
class GenerationCheck:
    """Greedy generation judged by ``verdict``; a generation without an answer scores 0."""

    kind: str
    verdict: Callable[[str, str], Verdict]

    def score(self, model: nn.Module, tokenizer: Any, task: Task, batch_size: int) -> EvalResult:
        was_training = model.training
        model.eval()
        try:
            predictions = generate_completions(
                model, tokenizer, task.eval, task.max_new_tokens, batch_size
            )
        finally:
            model.train(was_training)
        verdicts = [
            self.verdict(p, e.completion) for p, e in zip(predictions, task.eval, strict=True)
        ]
        unparsed = [i for i, v in enumerate(verdicts) if v is None]
        if unparsed:
            logger.warning(
                "%s: %d of %d generations hold no %s answer and score 0 (first: %r)",
                task.name,
                len(unparsed),
                len(verdicts),
                self.kind,
                predictions[unparsed[0]],
            )
        correct = [bool(v) for v in verdicts]
        return EvalResult(
            task.name,
            sum(correct) / len(correct),
            correct,
            predictions,
            metrics={"unparsed": float(len(unparsed))},
        )


def alias_verdict(prediction: str, example: Example) -> bool:
    """Whether the reference or an alias appears in ``prediction`` as whole words (any case)."""
    text = prediction.lower()
    for answer in (example.completion.lower().strip(), *example.aliases):
        if answer and re.search(rf"(?<![\w]){re.escape(answer)}(?![\w])", text):
            return True
    return False


@dataclass(frozen=True)
class AliasMatch:
    """Greedy generation checked against the reference and the example's aliases."""

    def score(self, model: nn.Module, tokenizer: Any, task: Task, batch_size: int) -> EvalResult:
        with evaluating(model):
            predictions = generate_completions(
                model, tokenizer, task.eval, task.max_new_tokens, batch_size
            )
        correct = [alias_verdict(p, e) for p, e in zip(predictions, task.eval, strict=True)]
        return EvalResult(task.name, sum(correct) / len(correct), correct, predictions)


@dataclass(frozen=True)
class EndsTurn:
    """The share of greedy generations that end with the EOS token inside the budget."""

    def score(self, model: nn.Module, tokenizer: Any, task: Task, batch_size: int) -> EvalResult:
        with evaluating(model):
            ids = generate_token_ids(model, tokenizer, task.eval, task.max_new_tokens, batch_size)
        correct = [tokenizer.eos_token_id in row for row in ids]
        predictions = list(tokenizer.batch_decode(ids, skip_special_tokens=True))
        return EvalResult(task.name, sum(correct) / len(correct), correct, predictions)


# --- multiple choice -----------------------------------------------------------------------------


def _choice_ids(tokenizer: Any, choice: str) -> list[int]:
    ids = list(tokenizer(choice, add_special_tokens=False)["input_ids"])
    if not ids:
        raise DataError(f"multiple choice: the choice {choice!r} encodes to no tokens")
    return ids


@torch.no_grad()
def choice_loglikelihoods(
    model: nn.Module, tokenizer: Any, examples: Sequence[Example], batch_size: int
) -> list[list[float]]:
    """Per example, per choice: ``sum_t log p(choice_t | prompt, choice_<t)``.

    The prompt is encoded as for training (chat template included) and the choice's tokens
    follow it directly, as the completion does in training; no end-of-sequence token is scored
    (as in lm-eval). ``batch_size`` questions run at a time: their prompts once, left-padded,
    keeping the key/value cache; then every choice continues its question's cache, and logits
    are computed only where a choice token is predicted (a large vocabulary's output layer over
    every prompt position would cost more than the model). An empty prompt is replaced by the
    EOS token, as lm-eval does with its prefix token. Too-long pairs lose prompt tokens on the
    left.
    """
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    items: list[tuple[list[int], list[list[int]]]] = []
    for ex in examples:
        if ex.choices is None:
            raise DataError(f"multiple choice: the example {ex.prompt!r} has no choices")
        prompt = encode_prompt(tokenizer, ex) or [tokenizer.eos_token_id]
        choices = [_choice_ids(tokenizer, text) for text in ex.choices]
        longest = max(len(c) for c in choices)
        cut = max(0, len(prompt) + longest - limit) if limit is not None else 0
        items.append((prompt[cut:], choices))
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    scores: list[list[float]] = []
    for start in range(0, len(items), batch_size):
        scores.extend(_score_choices(model, items[start : start + batch_size], pad_id))
    return scores


def _score_choices(
    model: nn.Module, items: list[tuple[list[int], list[list[int]]]], pad_id: int
) -> list[list[float]]:
    """One batch of questions: the prompts once (their shared head once for all), then each
    choice on its question's cache."""
    batch = prompt_batch(model, [prompt for prompt, _ in items], pad_id)
    keyword = cache_keyword(model)
    out = model(
        input_ids=batch.ids[:, batch.shared :],
        attention_mask=batch.mask,
        position_ids=batch.positions()[:, batch.shared :],
        use_cache=True,
        logits_to_keep=1,
        **batch.cache_kwargs(keyword),
    )
    first = torch.log_softmax(out.logits[:, -1].float(), dim=-1).cpu()
    cache = returned_cache(out)
    pairs = [(row, choice) for row, (_, choices) in enumerate(items) for choice in choices]
    totals = [float(first[row, choice[0]]) for row, choice in pairs]
    groups = _by_continuation_length(pairs)
    for number, (rest, members) in enumerate(groups):
        own = cache if number == len(groups) - 1 else copy.deepcopy(cache)
        values = _continuations(model, own, batch.mask, [pairs[i] for i in members], rest)
        for index, value in zip(members, values, strict=True):
            totals[index] += value
    scores: list[list[float]] = [[] for _ in items]
    for (row, _), total in zip(pairs, totals, strict=True):
        scores[row].append(total)
    return scores


def _by_continuation_length(pairs: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The pairs whose choice has tokens after its first, grouped by how many: each group runs
    unpadded (most answers are a token or two; padding all to the longest ran mostly padding)."""
    groups: dict[int, list[int]] = {}
    for index, (_, choice) in enumerate(pairs):
        if len(choice) > 1:
            groups.setdefault(len(choice) - 1, []).append(index)
    return sorted(groups.items())


def _continuations(
    model: nn.Module, cache: Any, mask: torch.Tensor, pairs: list[tuple[int, list[int]]], rest: int
) -> list[float]:
    """Each choice's ``rest`` tokens after its first (every choice here has as many), scored on
    a copy of its question's cache."""
    device = mask.device
    rows = torch.tensor([row for row, _ in pairs], device=device)
    cache.batch_select_indices(rows)
    ids = torch.tensor([choice[:-1] for _, choice in pairs], dtype=torch.long, device=device)
    full_mask = torch.cat([mask[rows], torch.ones_like(ids)], dim=1)
    positions = mask[rows].sum(-1, keepdim=True) + torch.arange(rest, device=device)
    logits = model(
        input_ids=ids,
        attention_mask=full_mask,
        position_ids=positions,
        use_cache=True,
        **{cache_keyword(model): cache},
    ).logits
    logp = torch.log_softmax(logits.float(), dim=-1).cpu()
    nexts = torch.tensor([choice[1:] for _, choice in pairs], dtype=torch.long)
    return logp.gather(-1, nexts.unsqueeze(-1)).squeeze(-1).double().sum(-1).tolist()


def _argmax(values: Sequence[float]) -> int:
    """Index of the largest value; the first one on ties (as ``numpy.argmax``)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def pick_choices(loglikelihoods: Sequence[float], choices: Sequence[str]) -> tuple[int, int]:
    """``(acc pick, acc_norm pick)``: argmax of the summed log-likelihood, and of it divided by
    the choice's length in characters (lm-eval's ``acc_norm``)."""
    raw = _argmax(loglikelihoods)
    norm = _argmax([ll / len(c) for ll, c in zip(loglikelihoods, choices, strict=True)])
    return raw, norm


@dataclass(frozen=True)
class MultipleChoice:
    """Multiple choice by log-likelihood; ``metric`` (``acc`` or ``acc_norm``) is the accuracy."""

    metric: str = "acc"

    def score(self, model: nn.Module, tokenizer: Any, task: Task, batch_size: int) -> EvalResult:
        was_training = model.training
        model.eval()
        try:
            lls = choice_loglikelihoods(model, tokenizer, task.eval, batch_size)
        finally:
            model.train(was_training)
        hits: dict[str, list[bool]] = {"acc": [], "acc_norm": []}
        predictions: list[str] = []
        for ex, ll in zip(task.eval, lls, strict=True):
            assert ex.choices is not None
            raw, norm = pick_choices(ll, ex.choices)
            hits["acc"].append(raw == ex.label)
            hits["acc_norm"].append(norm == ex.label)
            predictions.append(ex.choices[raw if self.metric == "acc" else norm])
        metrics = {k: sum(v) / len(v) for k, v in hits.items()}
        return EvalResult(
            task.name, metrics[self.metric], hits[self.metric], predictions, metrics=metrics
        )


def build_scorer(cfg: ScorerConfig | None) -> TaskScorer:
    """The scorer a task's config selects (None: exact match)."""
    if cfg is None or isinstance(cfg, ExactMatchScorer):
        return ExactMatch()
    if isinstance(cfg, MultipleChoiceScorer):
        return MultipleChoice(cfg.metric)
    if isinstance(cfg, NumericScorer):
        return GenerationCheck("numeric", lambda p, r: numeric_verdict(p, r, cfg))
    if isinstance(cfg, RegexScorer):
        return GenerationCheck("regex", lambda p, r: regex_verdict(p, r, cfg))
    if isinstance(cfg, ContainsScorer):
        return GenerationCheck("contains", contains_verdict)
    if isinstance(cfg, StartsWithScorer):
        return GenerationCheck("startswith", startswith_verdict)
    if isinstance(cfg, AliasScorer):
        return AliasMatch()
    if isinstance(cfg, EndsTurnScorer):
        return EndsTurn()
    raise TypeError(f"no scorer for {type(cfg).__name__}")


def score_task(model: nn.Module, tokenizer: Any, task: Task, batch_size: int) -> EvalResult:
    """Evaluate ``task`` with the scorer it is configured with."""
    return build_scorer(task.scoring).score(model, tokenizer, task, batch_size)


def chance_level(task: Task) -> float:
    """The score of guessing: ``1 / k`` averaged over a multiple-choice task's eval examples,
    0 for a generated answer (no guess is right by luck often enough to matter)."""
    if task.scoring is None or task.scoring.kind != "multiple_choice":
        return 0.0
    return sum(1 / len(e.choices or ()) for e in task.eval) / len(task.eval)
