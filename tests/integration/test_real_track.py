"""The real-model track's code paths on a tiny GGUF model: the smollm2 preset end to end, the
general probes, the prose measures, and the speed-ups that must not change a number."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_fixture import write_tiny_gguf
from rich.console import Console
from safetensors import safe_open
from torch import nn

from forgetless.config.loading import validate_config
from forgetless.config.presets import smollm2_config_dict
from forgetless.config.schema import ModelConfig
from forgetless.engine.loop import causal_lm_loss
from forgetless.eval.prose import encode_prose, prose_base, prose_row
from forgetless.eval.scorers import EndsTurn, alias_verdict, choice_loglikelihoods
from forgetless.models.loading import load_model_and_tokenizer
from forgetless.tasks.base import Example, Task
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import IGNORE_INDEX, completion_window, encode_prompt
from forgetless.tasks.general import prose_paragraphs, questions
from forgetless.training.runner import Runner


@pytest.fixture
def tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def _small_preset(model: Path) -> dict[str, Any]:
    data = copy.deepcopy(smollm2_config_dict())
    data["model"]["name_or_path"] = str(model)
    data["finetune"]["lora"]["layers"] = [1]
    data["train"].update(steps=2, batch_size=2, max_length=256)
    data["eval"].update(
        n_eval=3, n_train=8, between=2, batch_size=4, kl_examples=2, loglik_examples=2
    )
    data["eval"].update(prose_paragraphs=3, prose_kl_paragraphs=2, prose_max_tokens=64)
    data["tasks"] = data["tasks"][:2]
    for probe in data["probes"]:
        probe["n_eval"] = 4
    return data


def test_smollm2_preset_runs_end_to_end_on_a_tiny_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    cfg = validate_config(_small_preset(tiny_gguf))
    results = Runner(cfg, tmp_path / "run", Console(quiet=True), progress=False).run()
    data = results.to_json()
    assert data["status"] == "complete"
    assert data["probes"] == ["gk-mc", "gk-short", "chat-format"]
    assert data["probe_chance"] == [0.25, 0.0, 0.0]
    assert len(data["prose"]) == 3
    base = data["prose"][0]
    assert base["kl_base_to_model"] < 1e-3 and base["perplexity"] > 1
    assert data["metrics"]["prose"]["base_perplexity"] == base["perplexity"]
    adapter = next((tmp_path / "run").rglob("adapter_model.safetensors"))
    with safe_open(str(adapter), "pt") as handle:
        keys = list(handle.keys())
    assert keys and all(".layers.1." in k for k in keys)


def test_the_preset_validates_with_its_budget() -> None:
    cfg = validate_config(smollm2_config_dict(), "preset smollm2")
    assert cfg.model.name_or_path == "smollm2-135m-instruct"
    assert cfg.finetune.lora.layers == list(range(22, 30))
    assert cfg.eval.prose and cfg.eval.cache_base_row
    assert len(cfg.tasks) == 4


def test_choice_scores_from_the_cache_equal_full_forwards(tiny_gguf: Path) -> None:
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_gguf)))
    examples = [
        Example("hello there?", "yes", choices=("yes", "no thanks", "hell"), label=0),
        Example("a much longer question, it goes on?", "b", choices=("b", "cc dd ee"), label=0),
    ]
    fast = choice_loglikelihoods(model, tokenizer, examples, batch_size=2)
    for ex, scores in zip(examples, fast, strict=True):
        prompt = encode_prompt(tokenizer, ex)
        for choice, score in zip(ex.choices or (), scores, strict=True):
            ids = tokenizer(choice, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + ids])).logits[0]
            logp = torch.log_softmax(logits.float(), -1)
            want = sum(float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(ids))
            assert score == pytest.approx(want, abs=1e-4)


def test_completion_window_keeps_the_loss(tiny_gguf: Path) -> None:
    model, _ = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_gguf)))
    ids = torch.randint(3, 200, (3, 12))
    labels = torch.full((3, 12), IGNORE_INDEX)
    labels[0, 7:10], labels[1, 5:12], labels[2, 9:11] = 1, 2, 3
    keep = completion_window(labels)
    assert keep == 12 - 4  # position 4 predicts row 1's first label at 5
    with torch.no_grad():
        full = causal_lm_loss(model(input_ids=ids).logits, labels)
        cut = model(input_ids=ids, logits_to_keep=keep).logits
    assert cut.shape[1] == keep
    assert float(causal_lm_loss(cut, labels[:, -keep:])) == pytest.approx(float(full), abs=1e-6)


def test_prose_kl_is_zero_for_the_base_and_grows_with_a_change(tiny_gguf: Path) -> None:
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_gguf)))
    chunks = encode_prose(tokenizer, prose_paragraphs()[:3], 48)
    base = prose_base(model, chunks, 2)
    same = prose_row(model, chunks, base)
    assert same["kl_base_to_model"] < 1e-4
    assert same["perplexity"] == pytest.approx(base.perplexity, rel=1e-6)
    with torch.no_grad():
        model.model.norm.weight.mul_(20.0)  # sharper logits: another distribution
    moved = prose_row(model, chunks, base)
    assert moved["kl_base_to_model"] > 1e-3
    assert moved["perplexity"] != pytest.approx(base.perplexity, rel=1e-3)


def test_question_set_is_balanced_and_ordered_by_seed() -> None:
    items = questions()
    assert len(items) >= 300 and len({q["question"] for q in items}) == len(items)
    assert {sum(q["label"] == i for q in items) for i in range(4)} == {len(items) // 4}
    small = build_builtin_task("gk-mc", 0, 10, seed=3).eval
    assert small == build_builtin_task("gk-mc", 0, 20, seed=3).eval[:10]
    assert small != build_builtin_task("gk-mc", 0, 10, seed=4).eval
    assert all(len(e.choices or ()) == 4 for e in small)


@pytest.mark.parametrize(
    ("prediction", "good"),
    [("It is Four.", True), ("4 legs", True), ("fourteen", False), ("40", False), ("", False)],
)
def test_alias_verdict_takes_whole_words_in_any_case(prediction: str, good: bool) -> None:
    ex = Example("How many legs does a dog have?", "Four", aliases=("four", "4"))
    assert alias_verdict(prediction, ex) is good


class _Scripted(nn.Module):
    """``generate`` hands back fixed new tokens after the prompt (end-of-turn id 9)."""

    def __init__(self, rows: list[list[int]]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.rows = rows

    def generate(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        new = torch.tensor(self.rows[: input_ids.shape[0]])
        return torch.cat([input_ids, new], dim=1)


class _Tokenizer:
    """Every prompt is ids [1, 2]; no chat template; end-of-turn id 9."""

    pad_token_id, eos_token_id, chat_template = 0, 9, None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [1, 2]}

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return ["x"] * len(ids)


def test_ends_turn_is_the_share_that_stops_inside_the_budget() -> None:
    task = Task("chat-format", [], [Example("a?", "x"), Example("b?", "y")], max_new_tokens=3)
    model = _Scripted([[5, 9, 0], [5, 6, 7]])
    result = EndsTurn().score(model, _Tokenizer(), task, batch_size=8)
    assert result.accuracy == 0.5 and result.correct == [True, False]


def test_base_row_is_evaluated_once_and_read_after(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import tiny_run_config

    from forgetless.training.task_loop import TaskLoop

    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    raw = tiny_run_config(tiny_model_dir, tasks=["reverse", "cipher", "sort"])
    raw["eval"].update(cache_base_row=True, between=1)
    first = Runner(validate_config(raw), tmp_path / "a", Console(quiet=True), progress=False)
    one = first.run().to_json()
    assert len(list((tmp_path / "cache" / "base-rows").glob("*.json"))) == 1
    assert all(a in (0.0, 1.0) for a in one["accuracy_matrix"][1])  # 1 example between tasks

    evaluated: list[int] = []
    original = TaskLoop.record_row

    def counting(self: TaskLoop, results: Any, model: Any) -> Any:
        evaluated.append(len(results.accuracy))
        return original(self, results, model)

    monkeypatch.setattr(TaskLoop, "record_row", counting)
    two = Runner(validate_config(raw), tmp_path / "b", Console(quiet=True), progress=False)
    again = two.run().to_json()
    assert evaluated == [1, 2, 3]  # every row but the base
    for key in ("accuracy_matrix", "probe_accuracy", "loglik", "probe_loglik"):
        assert again[key][0] == one[key][0], key
    assert again["probe_chance"] == one["probe_chance"]
    assert list(again["eval_parts"][0]) == ["cache"] and "reverse" in again["eval_parts"][1]

    raw["probes"] = ["upper"]  # another probe: another key, evaluated afresh
    evaluated.clear()
    Runner(validate_config(raw), tmp_path / "c", Console(quiet=True), progress=False).run()
    assert evaluated == [0, 1, 2, 3]
