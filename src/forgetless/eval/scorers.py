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

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol

import torch
from torch import nn

from forgetless.config.evaluation import (
    ContainsScorer,
    ExactMatchScorer,
    MultipleChoiceScorer,
    NumericScorer,
    RegexScorer,
    ScorerConfig,
    StartsWithScorer,
)
from forgetless.errors import DataError
from forgetless.eval.generation import EvalResult, evaluate_task, generate_completions
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
    (as in lm-eval). Sequences of (prompt, choice) pairs run ``batch_size`` at a time, right-
    padded, so padding never precedes a scored token. An empty prompt is replaced by the EOS
    token, as lm-eval does with its prefix token. Too-long pairs lose prompt tokens on the left.
    """
    device = next(model.parameters()).device
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    pairs: list[tuple[int, list[int], list[int]]] = []
    for index, ex in enumerate(examples):
        if ex.choices is None:
            raise DataError(f"multiple choice: the example {ex.prompt!r} has no choices")
        prompt = encode_prompt(tokenizer, ex) or [tokenizer.eos_token_id]
        for text in ex.choices:
            choice_ids = _choice_ids(tokenizer, text)
            cut = max(0, len(prompt) + len(choice_ids) - limit) if limit is not None else 0
            pairs.append((index, prompt[cut:], choice_ids))
    scores: list[list[float]] = [[] for _ in examples]
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        width = max(len(p) + len(c) for _, p, c in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (_, prompt, choice) in enumerate(chunk):
            ids[row, : len(prompt) + len(choice)] = torch.tensor(prompt + choice)
            mask[row, : len(prompt) + len(choice)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()
        for row, (index, prompt, choice) in enumerate(chunk):
            # logits at position t predict token t + 1: the choice's tokens sit at
            # len(prompt) .. len(prompt) + len(choice) - 1.
            positions = torch.arange(len(prompt) - 1, len(prompt) + len(choice) - 1)
            picked = logp[row, positions, torch.tensor(choice)]
            scores[index].append(float(picked.double().sum()))
    return scores


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
