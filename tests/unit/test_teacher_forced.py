"""The budget's cheap accuracy: teacher-forced exact match gives greedy decoding's verdicts, but
for answers exact match accepts in another spelling (a trailing space, then no end token)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from forgetless.config.loading import load_config
from forgetless.eval.generation import evaluate_task, teacher_forced_match
from forgetless.models.loading import load_model_and_tokenizer
from forgetless.training.pretrain import SHIPPED_BASE
from forgetless.training.runner import load_tasks

NOISE = 0.05


@pytest.mark.parametrize("probe", ["copy", "upper", "facts", "add"])
def test_teacher_forced_match_agrees_with_greedy_decoding(probe: str) -> None:
    cfg = load_config(None, preset="tiny")
    cfg.model.name_or_path = str(SHIPPED_BASE)
    model, tokenizer = load_model_and_tokenizer(cfg.model, str(SHIPPED_BASE))
    task = load_tasks([t for t in cfg.probes if t.display_name == probe], cfg)[0]
    task = dataclasses.replace(task, eval=task.train[:48])
    torch.manual_seed(0)
    with torch.no_grad():  # a damaged base: some answers right, some wrong
        for param in model.parameters():
            param.add_(torch.randn_like(param) * NOISE)
    greedy = evaluate_task(model, tokenizer, task, 48).correct
    forced = teacher_forced_match(model, tokenizer, task.eval, cfg.train.max_length)
    assert 0 < sum(greedy) < len(greedy), sum(greedy)
    assert all(g for f, g in zip(forced, greedy, strict=True) if f)  # forced right: greedy right
    agree = sum(f == g for f, g in zip(forced, greedy, strict=True)) / len(greedy)
    assert agree >= 0.95, agree  # the rest: an answer the scorer takes with a trailing space


def test_the_budget_measure_encodes_its_probe_batch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from forgetless.config.budget import BudgetConfig
    from forgetless.tasks import formatting
    from forgetless.training import budget_probe

    cfg = load_config(None, preset="tiny")
    model, tokenizer = load_model_and_tokenizer(cfg.model, str(SHIPPED_BASE))
    probes = load_tasks(cfg.probes, cfg)
    encoded = []
    real_encode = formatting.encode_example

    def counting(*args: object, **kwargs: object) -> object:
        encoded.append(1)
        return real_encode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("forgetless.eval.generation.encode_example", counting)
    budget = BudgetConfig.model_validate({"max_loss": 0.05, "probe_batch": 32})
    measure = budget_probe.budget_measure(budget, model, tokenizer, probes, cfg.train.max_length)
    once = len(encoded)
    with torch.no_grad():
        losses = [measure(model) for _ in range(3)]
        for param in model.parameters():
            param.add_(torch.randn_like(param) * NOISE)
        damaged = measure(model)
    assert len(encoded) == once  # checks reuse the batch encoded when the measure was built
    assert losses[0] == losses[1] == losses[2] < damaged  # the base is within; noise costs
    batch = budget_probe.probe_batch(probes, 32)
    for probe in batch:  # the cached batch scores as the uncached one does
        hits = teacher_forced_match(model, tokenizer, probe.eval, cfg.train.max_length)
        score = budget_probe.probe_scorer(tokenizer, probe, cfg.train.max_length)
        assert score(model) == sum(hits) / len(hits)


def test_teacher_forced_logprobs_skip_the_prompt_and_keep_every_completion_token() -> None:
    from forgetless.eval.generation import forced_logprobs, teacher_forced_inputs
    from forgetless.tasks.formatting import IGNORE_INDEX

    cfg = load_config(None, preset="tiny")
    model, tokenizer = load_model_and_tokenizer(cfg.model, str(SHIPPED_BASE))
    task = load_tasks([t for t in cfg.probes if t.display_name == "facts"], cfg)[0]
    inputs = teacher_forced_inputs(tokenizer, task.eval[:16], cfg.train.max_length)
    logp, mask = forced_logprobs(model, inputs)
    with torch.no_grad():
        full = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    labels = inputs["labels"][:, 1:]
    whole = torch.log_softmax(full[:, :-1].float(), dim=-1)
    assert logp.shape[1] < whole.shape[1]  # the prompt's positions are not scored
    gold = whole.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[labels != IGNORE_INDEX]
    kept = labels[:, -logp.shape[1] :]
    windowed = logp.gather(-1, kept.clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask]
    assert int(mask.sum()) == int((labels != IGNORE_INDEX).sum())  # no completion token is lost
    torch.testing.assert_close(windowed, gold)


def test_the_shared_prefix_stops_where_rows_differ_or_logits_are_asked_for() -> None:
    from forgetless.eval.generation import shared_prefix

    ids = torch.tensor([[5, 6, 7, 1, 2], [5, 6, 8, 3, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert shared_prefix(ids, mask, limit=5) == 2
    assert shared_prefix(ids, mask, limit=1) == 1  # a row's first predicted token is earlier
    assert shared_prefix(ids[:, :2], mask[:, :2], limit=2) == 2  # every position alike
    assert shared_prefix(ids, torch.zeros_like(mask), limit=5) == 0  # padding is never shared


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_rows_continue_a_shared_chat_prefix_with_the_full_forwards_values(
    tmp_path: Path, arch: str
) -> None:
    from forgetless.eval.generation import forced_logprobs, shared_prefix, teacher_forced_inputs
    from forgetless.tasks.formatting import IGNORE_INDEX
    from forgetless.testing import save_tiny

    folder = save_tiny(tmp_path / arch, arch=arch, chat=True)
    cfg = load_config(None, preset="tiny")
    cfg.model.name_or_path = str(folder)
    model, tokenizer = load_model_and_tokenizer(cfg.model, str(folder))
    task = load_tasks([t for t in cfg.probes if t.display_name == "copy"], cfg)[0]
    inputs = teacher_forced_inputs(tokenizer, task.eval[:8], 64)
    assert shared_prefix(inputs["input_ids"], inputs["attention_mask"], 64) > 8  # <user>copy:
    logp, mask = forced_logprobs(model, inputs)
    with torch.no_grad():
        full = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    labels = inputs["labels"][:, 1:]
    whole = torch.log_softmax(full[:, :-1].float(), dim=-1)
    gold = whole.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[labels != IGNORE_INDEX]
    kept = labels[:, -logp.shape[1] :]
    cached = logp.gather(-1, kept.clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask]
    torch.testing.assert_close(cached, gold, atol=1e-4, rtol=1e-4)
