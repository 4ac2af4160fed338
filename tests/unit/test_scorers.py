"""Scorers: answer extraction, multiple choice by log-likelihood, batching, chat, config."""

from __future__ import annotations

import logging
import math
import re
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from conftest import tiny_run_config, write_jsonl
from rich.console import Console
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from forgetless.config.evaluation import LmEvalProbe, NumericScorer, RegexScorer
from forgetless.config.loading import validate_config
from forgetless.config.schema import EvalConfig, TaskConfig
from forgetless.errors import ConfigError, DataError
from forgetless.eval import scorers
from forgetless.eval.generation import evaluate_task
from forgetless.eval.scorers import (
    MultipleChoice,
    build_scorer,
    choice_loglikelihoods,
    contains_verdict,
    extract_number,
    numeric_verdict,
    pick_choices,
    regex_verdict,
    score_task,
    startswith_verdict,
)
from forgetless.models.tiny import build_char_tokenizer
from forgetless.tasks.base import Example, Task
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import encode_prompt
from forgetless.tasks.loaders import build_task, read_jsonl
from forgetless.training.runner import Runner

DOCS = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"


def load(model_dir: Path) -> tuple[nn.Module, Any]:
    return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


# --- answer extraction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the total is #### 1,234", Decimal(1234)),
        ("12+3=15 #### -7", Decimal(-7)),
        ("#### 3.50", Decimal("3.5")),
        ("we get 42.", Decimal(42)),
        ("first 12 then 7", Decimal(7)),
        ("a=3,b=7", Decimal(7)),  # "3,b" is not a thousands group
        ("-12 and -0.5", Decimal("-0.5")),
        ("#### 5 then 9", Decimal(5)),  # the number after #### wins over a later one
        ("1,234,567 apples", Decimal(1234567)),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_number(text: str, expected: Decimal | None) -> None:
    assert extract_number(text) == expected


def test_extract_number_strict_needs_the_marker() -> None:
    assert extract_number("the answer is 5", strict=True) is None
    assert extract_number("5 #### 6", strict=True) == Decimal(6)


def test_numeric_verdict() -> None:
    cfg = NumericScorer(strict=False, tolerance=0.0)
    assert numeric_verdict("19-3 #### 16", "19-3 #### 16", cfg) is True
    assert numeric_verdict("20-4 #### 16.0", "19-3 #### 16", cfg) is True  # only the answer
    assert numeric_verdict("#### 17", "#### 16", cfg) is False
    assert numeric_verdict("I don't know", "#### 16", cfg) is None
    assert numeric_verdict("#### 16.04", "16", NumericScorer(strict=False, tolerance=0.05))
    with pytest.raises(DataError, match="holds no number"):
        numeric_verdict("16", "sixteen", cfg)


def test_regex_contains_startswith_verdicts() -> None:
    cfg = RegexScorer(pattern=r"answer: (\w+)", group=1)
    assert regex_verdict("so the answer: foo.", "foo", cfg) is True
    assert regex_verdict("answer: bar", "the answer: foo", cfg) is False
    assert regex_verdict("answer: foo", "the answer: foo", cfg) is True
    assert regex_verdict("no idea", "foo", cfg) is None
    assert contains_verdict("xx foo yy", " foo ") and not contains_verdict("fo", "foo")
    assert startswith_verdict("  foo bar", "foo") and not startswith_verdict("bar foo", "foo")


def test_generation_check_scores_unparsable_as_zero_and_logs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    outputs = ["x #### 4", "#### 5", "no number", "1,000"]
    monkeypatch.setattr(scorers, "generate_completions", lambda *a, **k: list(outputs))
    task = Task(
        "nums",
        [],
        [Example(f"q{i}", r) for i, r in enumerate(["4", "#### 6", "1", "#### 1000"])],
    )
    scorer = build_scorer(NumericScorer(strict=False, tolerance=0.0))
    with caplog.at_level(logging.WARNING, logger="forgetless.eval.scorers"):
        result = scorer.score(nn.Linear(1, 1), None, task, batch_size=2)
    assert result.correct == [True, False, False, True] and result.accuracy == 0.5
    assert result.metrics["unparsed"] == 1
    assert "1 of 4 generations hold no numeric answer" in caplog.text and "no number" in caplog.text


# --- multiple choice ------------------------------------------------------------------------------


class _StatelessCache:
    """A bigram needs no past: selecting or repeating rows of its cache changes nothing."""

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        del rows

    def batch_repeat_interleave(self, repeats: int) -> None:
        del repeats


class BigramModel(nn.Module):
    """Logits at each position depend only on the current token: a table set by hand. Called
    like a Hugging Face causal LM (``logits_to_keep``, a cache it hands back)."""

    def __init__(self, log_probs: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(log_probs)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int = 0,
        **_: Any,
    ) -> Any:
        logits = self.table[input_ids]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits, past_key_values=_StatelessCache())


def _bigram(tokenizer: Any, rows: dict[str, dict[str, float]]) -> BigramModel:
    """Next-token log-probs: ``rows[prev][next]``; the rest of each row's mass spread evenly."""
    vocab = len(tokenizer)
    table = torch.zeros(vocab, vocab)
    for prev, nexts in rows.items():
        probs = torch.zeros(vocab)
        for token, logp in nexts.items():
            probs[tokenizer.convert_tokens_to_ids(token)] = math.exp(logp)
        rest = probs == 0
        probs[rest] = (1 - probs.sum()) / rest.sum()
        table[tokenizer.convert_tokens_to_ids(prev)] = probs.log()
    return BigramModel(table)


def test_multiple_choice_picks_by_raw_and_normalized_loglikelihood() -> None:
    tokenizer = build_char_tokenizer()
    # After "=": p(a) = e^-1, p(b) = e^-0.6; after "b": p(b) = e^-0.6. So ll(a) = -1.0 and
    # ll(bb) = -1.2: raw picks "a", per-character (-1.0 vs -0.6) picks "bb".
    model = _bigram(tokenizer, {"=": {"a": -1.0, "b": -0.6}, "b": {"b": -0.6}})
    ex = Example("q=", "a", choices=("a", "bb"), label=0)
    [lls] = choice_loglikelihoods(model, tokenizer, [ex], batch_size=4)
    assert lls == pytest.approx([-1.0, -1.2], abs=1e-5)
    assert pick_choices(lls, ex.choices) == (0, 1)
    task = Task("mc", [], [ex, Example("q=", "bb", choices=("a", "bb"), label=1)])
    acc = MultipleChoice("acc").score(model, tokenizer, task, batch_size=3)
    norm = MultipleChoice("acc_norm").score(model, tokenizer, task, batch_size=3)
    assert acc.correct == [True, False] and acc.predictions == ["a", "a"]
    assert norm.correct == [False, True] and norm.predictions == ["bb", "bb"]
    assert acc.metrics == norm.metrics == {"acc": 0.5, "acc_norm": 0.5}


def test_pick_choices_ties_take_the_first() -> None:
    assert pick_choices([-2.0, -2.0, -3.0], ["aa", "bb", "c"]) == (0, 0)


def test_acc_norm_divides_by_characters_not_bytes() -> None:
    # Per character: -2/2 = -1.0 vs -2.9/3 = -0.967 -> "abc"; per UTF-8 byte "éé" (4 bytes)
    # would give -0.5 and pick it instead.
    assert pick_choices([-2.0, -2.9], ["éé", "abc"]) == (0, 1)


def _hand_loglikelihood(model: nn.Module, prompt: list[int], choice: list[int]) -> float:
    ids = torch.tensor([prompt + choice])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return sum(float(logp[len(prompt) - 1 + k, tok]) for k, tok in enumerate(choice))


@torch.no_grad()
def test_loglikelihood_equals_hand_computation_on_tiny_model(tiny_model_dir: Path) -> None:
    model, tokenizer = load(tiny_model_dir)
    model.eval()
    examples = build_builtin_task("addmc", 0, 3, seed=0).eval
    lls = choice_loglikelihoods(model, tokenizer, examples, batch_size=5)
    for ex, row in zip(examples, lls, strict=True):
        assert ex.choices is not None
        prompt = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
        hand = [
            _hand_loglikelihood(model, prompt, tokenizer(c, add_special_tokens=False)["input_ids"])
            for c in ex.choices
        ]
        assert row == pytest.approx(hand, abs=1e-4)
        raw, norm = pick_choices(row, ex.choices)
        assert raw == max(range(4), key=lambda i: hand[i])
        assert norm == max(range(4), key=lambda i: hand[i] / len(ex.choices[i]))


def test_multiple_choice_batched_equals_unbatched(tiny_model_dir: Path) -> None:
    model, tokenizer = load(tiny_model_dir)
    task = build_builtin_task("addmc", 0, 9, seed=1)
    one = choice_loglikelihoods(model, tokenizer, task.eval, batch_size=1)
    many = choice_loglikelihoods(model, tokenizer, task.eval, batch_size=7)
    for a, b in zip(one, many, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    r1 = MultipleChoice().score(model, tokenizer, task, batch_size=1)
    r7 = MultipleChoice().score(model, tokenizer, task, batch_size=7)
    assert (r1.correct, r1.metrics) == (r7.correct, r7.metrics)


def test_generation_scorer_batched_equals_unbatched(tiny_model_dir: Path) -> None:
    model, tokenizer = load(tiny_model_dir)
    task = build_builtin_task("calc", 0, 6, seed=0)
    a = score_task(model, tokenizer, task, batch_size=1)
    b = score_task(model, tokenizer, task, batch_size=6)
    assert a.predictions == b.predictions and a.correct == b.correct


def test_chat_template_is_applied_to_choices(tiny_llama_chat_dir: Path) -> None:
    model, tokenizer = load(tiny_llama_chat_dir)
    model.eval()
    ex = Example("pick 1+1=", "2", choices=("2", "11"), label=0)
    prompt = encode_prompt(tokenizer, ex)
    rendered = tokenizer("<user>pick 1+1=<assistant>", add_special_tokens=False)["input_ids"]
    assert prompt == rendered  # the template, not the raw prompt
    [lls] = choice_loglikelihoods(model, tokenizer, [ex], batch_size=2)
    with torch.no_grad():
        hand = [
            _hand_loglikelihood(
                model, rendered, tokenizer(c, add_special_tokens=False)["input_ids"]
            )
            for c in ex.choices
        ]
        raw = tokenizer("pick 1+1=", add_special_tokens=False)["input_ids"]
        without = _hand_loglikelihood(
            model, raw, tokenizer("2", add_special_tokens=False)["input_ids"]
        )
    assert lls == pytest.approx(hand, abs=1e-4)
    assert lls[0] != pytest.approx(without, abs=1e-4)


def test_exact_match_default_is_unchanged(tiny_model_dir: Path) -> None:
    model, tokenizer = load(tiny_model_dir)
    task = build_builtin_task("reverse", 0, 8, seed=0)
    old, new = evaluate_task(model, tokenizer, task, 4), score_task(model, tokenizer, task, 4)
    assert (old.accuracy, old.correct, old.predictions) == (
        new.accuracy,
        new.correct,
        new.predictions,
    )
    assert isinstance(build_scorer(None), type(build_scorer(task.scoring)))


def test_builtin_scoring_kinds() -> None:
    assert build_builtin_task("addmc", 4, 4, 0).scoring.kind == "multiple_choice"  # type: ignore[union-attr]
    assert build_builtin_task("calc", 4, 4, 0).scoring.kind == "numeric"  # type: ignore[union-attr]
    assert build_builtin_task("copy", 4, 4, 0).scoring.kind == "exact_match"  # type: ignore[union-attr]
    for ex in build_builtin_task("addmc", 50, 50, 0).eval:
        assert ex.choices is not None and ex.choices[ex.label or 0] == ex.completion
        assert len(set(ex.choices)) == 4
    for ex in build_builtin_task("calc", 50, 50, 0).eval:
        a, b, c = map(int, re.findall(r"\d+", ex.prompt))
        assert extract_number(ex.completion, strict=True) == a + b - c


# --- data and config -----------------------------------------------------------------------------


def test_jsonl_choices_and_label(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "mc.jsonl",
        [
            {"prompt": "2+2=", "choices": ["3", "4"], "label": 1},
            {"prompt": "1+1=", "choices": ["2", "3"], "label": 0, "completion": "two"},
        ],
    )
    a, b = read_jsonl(path)
    assert (a.choices, a.label, a.completion) == (("3", "4"), 1, "4")
    assert b.completion == "two"
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "choices": ["x", "y"], "label": 2}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: 'label' must be the index"):
        read_jsonl(bad)


def test_hf_column_mapping_for_choices(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"question": f"q{i}=", "options": ["a", "b", "c"], "answer": i % 3} for i in range(6)],
    )
    cfg = TaskConfig.model_validate(
        {
            "hf": {
                "path": "json",
                "data_files": str(path),
                "prompt_column": "question",
                "choices_column": "options",
                "label_column": "answer",
                "eval_fraction": 0.5,
            },
            "name": "mcq",
            "scorer": "multiple_choice",
        }
    )
    task = build_task(cfg, EvalConfig(), seed=0)
    assert task.scoring is not None and task.scoring.kind == "multiple_choice"
    assert all(
        e.choices == ("a", "b", "c") and e.completion == "abc"[e.label or 0] for e in task.eval
    )


def test_multiple_choice_scorer_needs_choices(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl", [{"prompt": f"p{i}", "completion": "c"} for i in range(4)]
    )
    cfg = TaskConfig.model_validate({"jsonl": {"train": str(path)}, "scorer": "multiple_choice"})
    with pytest.raises(DataError, match="have no choices"):
        build_task(cfg, EvalConfig(), seed=0)


@pytest.mark.parametrize(
    ("scorer", "needle"),
    [
        ("bogus", "tasks.0.scorer: unknown scorer kind 'bogus'"),
        ({"kind": "regex", "pattern": "("}, "scorer.pattern is not a valid regex"),
        ({"kind": "regex", "pattern": "a", "group": 1}, "scorer.group 1 but the pattern has 0"),
        ({"kind": "numeric", "tolerance": -1}, "tasks.0.scorer.numeric.tolerance"),
        ({"kind": "multiple_choice", "metric": "f1"}, "tasks.0.scorer.multiple_choice.metric"),
        ({"kind": "contains", "extra": 1}, "tasks.0.scorer.contains.extra: Extra inputs"),
    ],
)
def test_scorer_config_errors_are_one_line(scorer: Any, needle: str, tmp_path: Path) -> None:
    data = tiny_run_config(tmp_path, tasks=[{"builtin": "reverse", "scorer": scorer}])
    with pytest.raises(ConfigError) as info:
        validate_config(data)
    message = str(info.value)
    assert "\n" not in message and needle in message


def test_scorer_shorthand_and_probe_forms(tmp_path: Path) -> None:
    cfg = validate_config(
        tiny_run_config(
            tmp_path,
            tasks=[{"builtin": "reverse", "scorer": "contains"}, "calc"],
            probes=["copy", "lmeval:hellaswag", {"lm_eval": {"tasks": ["arc_easy", "piqa"]}}],
        )
    )
    assert cfg.tasks[0].scorer is not None and cfg.tasks[0].scorer.kind == "contains"
    assert cfg.tasks[1].scorer is None
    assert isinstance(cfg.probes[1], LmEvalProbe) and cfg.probes[1].names == ["lmeval:hellaswag"]
    assert isinstance(cfg.probes[2], LmEvalProbe) and cfg.probes[2].lm_eval.limit is None


@pytest.mark.parametrize(
    ("probe", "needle"),
    [
        ({"lm_eval": {"tasks": []}}, "probes.0.lm_eval.lm_eval.tasks"),
        ({"lm_eval": {"tasks": ["a"], "limit": 0}}, "lm_eval.limit"),
        ({"lm_eval": {"tasks": ["a"], "shots": 5}}, "lm_eval.shots: Extra inputs"),
        ({"lm_eval": {"tasks": ["a"], "include_defaults": False}}, "needs an include_path"),
    ],
)
def test_lm_eval_probe_config_errors_are_one_line(probe: Any, needle: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(tiny_run_config(tmp_path, probes=[probe]))
    assert "\n" not in str(info.value) and needle in str(info.value)


def test_lm_eval_probe_names_must_be_unique(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="repeated: lmeval:piqa"):
        validate_config(tiny_run_config(tmp_path, probes=["lmeval:piqa", "lmeval:piqa"]))


def test_worked_example_config_in_docs_validates() -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.S)
    configs = [yaml.safe_load(b) for b in blocks if "tasks:" in b and "method:" in b]
    assert configs, "docs/evaluation.md lost its worked example"
    for data in configs:
        cfg = validate_config(data)
        assert any(isinstance(p, LmEvalProbe) for p in cfg.probes)


# --- through the runner --------------------------------------------------------------------------


def test_builtin_mc_and_numeric_tasks_run_through_the_runner(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = validate_config(
        tiny_run_config(
            tiny_model_dir,
            tasks=["addmc", "calc"],
            probes=["copy"],
            train={"steps": 2, "batch_size": 4, "lr": 1e-3, "max_length": 32},
        )
    )
    results = Runner(cfg, tmp_path, Console(quiet=True), progress=False).run().to_json()
    assert results["tasks"] == ["addmc", "calc"] and len(results["accuracy_matrix"]) == 3
    assert all(0.0 <= a <= 1.0 for row in results["accuracy_matrix"] for a in row)
    # Row 0 is the base model scored by each task's own scorer.
    model, tokenizer = load(tiny_model_dir)
    base = [
        score_task(model, tokenizer, build_task(t, cfg.eval, cfg.seed), cfg.eval.batch_size)
        for t in cfg.tasks
    ]
    assert results["accuracy_matrix"][0] == [r.accuracy for r in base]
    assert set(base[0].metrics) == {"acc", "acc_norm"} and "unparsed" in base[1].metrics
    # An untrained model never writes the exact answer, but log-likelihood finds some sums.
    assert results["accuracy_matrix"][0][0] > 0
