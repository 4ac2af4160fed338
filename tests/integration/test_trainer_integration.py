"""forgetless.integrations: a forgetting-control method inside transformers' ``Trainer`` and
TRL's ``SFTTrainer``, with the same hooks, the same terms and the same state as a forgetless run
(docs/integrations.md)."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

import forgetless
from forgetless.bench.stats import mean_interval
from forgetless.contract import Capability, RunInfo, TaskContext, TrainPlan, registered_methods
from forgetless.core import registry
from forgetless.engine import loop as engine_loop
from forgetless.eval.generation import teacher_forced_inputs, teacher_forced_logits
from forgetless.integrations import (
    ForgettingControl,
    TrainerRefusal,
    refusal,
    trainer_support,
    with_method,
)
from forgetless.integrations.batches import uncollate
from forgetless.integrations.control import placeholder_task
from forgetless.methods.token_weighting import dft_loss
from forgetless.models.tiny import build_char_tokenizer
from forgetless.tasks.base import Task
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import IGNORE_INDEX, Features, collate, encode_example
from forgetless.testing import smoke_method

try:
    from trl import SFTConfig, SFTTrainer
except ImportError:  # trl is an extra (forgetless[rl]; dev on Python >= 3.11)
    SFTConfig = SFTTrainer = None

TRAINERS = [
    pytest.param(Trainer, id="Trainer"),
    pytest.param(
        SFTTrainer,
        id="SFTTrainer",
        marks=pytest.mark.skipif(SFTTrainer is None, reason="needs trl"),
    ),
]
DOCS = Path(__file__).parents[2] / "docs" / "integrations.md"
SHIPPED_BASE = Path(forgetless.__file__).parent / "assets" / "tiny-base"
MAX_LENGTH = 64

hf_logging.set_verbosity_error()


def features(tokenizer: Any, name: str, n: int, seed: int = 0) -> list[Features]:
    task = build_builtin_task(name, n_train=n, n_eval=8, seed=seed)
    return [encode_example(tokenizer, e, MAX_LENGTH) for e in task.train]


def arguments(trainer_cls: type[Trainer], out: Path, steps: int, **kw: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 8,
        "max_steps": steps,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "seed": 0,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "logging_steps": 1000,
        **kw,
    }
    if trainer_cls is SFTTrainer:
        return SFTConfig(bf16=False, max_length=MAX_LENGTH, **settings)
    return TrainingArguments(**settings)


def trainer_kwargs(
    trainer_cls: type[Trainer], model: Any, tokenizer: Any, args: Any, data: list[Features]
) -> dict[str, Any]:
    """What a script hands the trainer: SFTTrainer a datasets.Dataset it prepares itself,
    Trainer a list of features and a collator."""
    if trainer_cls is SFTTrainer:
        return {
            "model": model,
            "args": args,
            "train_dataset": Dataset.from_list(data),
            "processing_class": tokenizer,
        }
    return {
        "model": model,
        "args": args,
        "train_dataset": data,
        "data_collator": lambda f: collate(f, tokenizer.pad_token_id),
        "processing_class": tokenizer,
    }


def next_data(trainer_cls: type[Trainer], data: list[Features]) -> Any:
    return Dataset.from_list(data) if trainer_cls is SFTTrainer else data


def smoke_options(name: str) -> dict[str, Any]:
    config, _ = smoke_method(name)
    return {k: v for k, v in config.items() if k != "name"}


def forgetless_step(
    model_dir: Path, weights: dict[str, torch.Tensor], method: Any,
    batch: dict[str, torch.Tensor], tokenizer: Any, out: Path, monkeypatch: pytest.MonkeyPatch,
) -> dict[str, float]:  # fmt: skip
    """The terms of forgetless's own step loop (``StepLoop.run``, one step) for ``method`` on
    ``batch`` (taken apart into features as the trainer collated it), from ``weights``, as the
    second task of a run with seed 0."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    model.load_state_dict(weights)
    feats = uncollate(batch)
    monkeypatch.setattr(engine_loop, "batches", lambda *a, **k: iter([feats]))
    info = RunInfo(0, out, ["task-1", "task-2"], [], "full", max_length=128)
    task = placeholder_task("task-2")
    past = [placeholder_task("task-1")]
    ctx = TaskContext(info, 2, task, model, tokenizer, feats, past, torch.device("cpu"), past)
    seen: list[dict[str, float]] = []
    loop = engine_loop.StepLoop(
        model, method, ctx, tokenizer.pad_token_id, on_step=lambda _, t: seen.append(t)
    )
    loop.run(feats, TrainPlan(steps=1, batch_size=len(feats), lr=1e-3, seed=0))
    return seen[0]


@pytest.mark.parametrize("trainer_cls", TRAINERS)
@pytest.mark.parametrize("name", ["seq_ft", "ewc", "replay", "kl_sft", "dft", "asft", "eaft"])
def test_the_first_step_of_a_task_has_the_terms_of_a_forgetless_step(
    name: str, trainer_cls: type[Trainer], tiny_model_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Task 1 in the trainer, its end (Fisher, memory, reference) through ``next_task``; then
    the first batch of task 2 as the trainer saw it goes through forgetless's step loop from
    the same weights and method state: every named term agrees to 1e-5."""
    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    control = ForgettingControl(name, **smoke_options(name))
    seen: list[tuple[dict[str, torch.Tensor], dict[str, float]]] = []

    class Spy(with_method(trainer_cls, control)):  # type: ignore[misc]
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
            batch = {k: v.detach().clone() for k, v in inputs.items()}
            loss = super().compute_loss(model, inputs, *args, **kw)
            seen.append((batch, dict(control.step_loss.last)))  # type: ignore[union-attr]
            return loss

    args = arguments(trainer_cls, tmp_path, steps=3)
    data1, data2 = features(tokenizer, "reverse", 16), features(tokenizer, "cipher", 16)
    trainer = Spy(**trainer_kwargs(trainer_cls, model, tokenizer, args, data1))
    trainer.train()
    trainer.next_task(next_data(trainer_cls, data2))  # task 1's end: Fisher, memory
    with torch.no_grad():  # off EWC's anchor, so that its first penalty is not zero
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.01)
    before, method = copy.deepcopy(model.state_dict()), copy.deepcopy(control.method)
    first = len(seen)
    trainer.train()
    batch, terms = seen[first]
    expected = forgetless_step(
        tiny_model_dir, before, method, batch, tokenizer, tmp_path, monkeypatch
    )
    expected.pop("loss")
    assert set(terms) == set(expected) == {"task"} | ({name} & {"ewc", "kl_sft"})
    gaps = {key: abs(terms[key] - value) for key, value in expected.items()}
    print(f"{name} in {trainer_cls.__name__}: {terms} vs forgetless {expected}")
    assert max(gaps.values()) < 1e-5, gaps
    if name == "ewc":
        assert terms["ewc"] > 0  # a real penalty: task 1's Fisher and anchor
    if name == "replay":
        assert len(control.method.buffer) == 16  # task 1's examples, memory carried over


def test_a_replaced_task_loss_is_normalised_as_the_trainer_normalises_its_own(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two accumulated micro-batches of unequal scored tokens: each one's DFT loss is its sum
    over the tokens of both (``num_items_in_batch``), as the trainer's own cross-entropy is."""
    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    seen: list[tuple[float, float, int, int]] = []

    class Spy(with_method(Trainer, "dft")):  # type: ignore[misc]
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kw)
            items, labels = kw["num_items_in_batch"], inputs["labels"]
            with torch.no_grad():
                logits = model(
                    input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
                )
                expected = dft_loss(logits.logits, labels, items)
            tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
            seen.append((float(loss.detach()), float(expected), int(items), tokens))
            return loss

    args = arguments(Trainer, tmp_path, steps=1, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2)  # fmt: skip
    data = features(tokenizer, "reverse", 8)
    Spy(**trainer_kwargs(Trainer, model, tokenizer, args, data)).train()
    (loss_a, expected_a, items, tokens_a), (loss_b, expected_b, items_b, tokens_b) = seen
    assert items == items_b == tokens_a + tokens_b and tokens_a != tokens_b
    assert loss_a == pytest.approx(expected_a, abs=1e-6)
    assert loss_b == pytest.approx(expected_b, abs=1e-6)


def two_tasks(
    trainer_cls: type[Trainer], control: ForgettingControl, model_dir: Path, out: Path,
    steps: int = 2, callbacks: list[TrainerCallback] | None = None, **kw: Any,
) -> Trainer:  # fmt: skip
    """Two tasks of ``steps`` steps (reverse, cipher) through one trainer and ``next_task``."""
    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    args = arguments(trainer_cls, out, steps=steps, **kw)
    data1, data2 = features(tokenizer, "reverse", 16), features(tokenizer, "cipher", 16)
    trainer = with_method(trainer_cls, control)(
        **trainer_kwargs(trainer_cls, model, tokenizer, args, data1), callbacks=callbacks
    )
    trainer.train()
    trainer.next_task(next_data(trainer_cls, data2), name="cipher")
    trainer.train()
    trainer.end_task()
    return trainer


@pytest.mark.parametrize(
    ("flag", "engine"), [("is_fsdp_enabled", "FSDP"), ("is_deepspeed_enabled", "DeepSpeed")]
)
def test_a_trainer_that_shards_is_refused_in_one_line(
    tiny_model_dir: Path, tmp_path: Path, flag: str, engine: str
) -> None:
    """A trainer whose accelerator splits the weights or the optimizer (as transformers marks
    it) is refused as it is built, before the method touches a weight."""

    class Sharded(Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            setattr(self, flag, True)

    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    args = arguments(Trainer, tmp_path, steps=1)
    data = features(tokenizer, "reverse", 4)
    with pytest.raises(TrainerRefusal, match=rf"^forgetless.integrations .* not under {engine}:"):
        with_method(Sharded, "ewc")(**trainer_kwargs(Trainer, model, tokenizer, args, data))


def documented_lines() -> dict[str, str]:
    """The table of docs/integrations.md: method name -> its cell (a refusal or 'runs')."""
    text = DOCS.read_text(encoding="utf-8").split("## Which methods run inside a trainer")[1]
    return dict(re.findall(r"^\| `(\w+)` \| (.+) \|$", text.split("\n## ")[0], re.M))


def test_every_registered_method_runs_in_a_trainer_or_refuses_in_its_documented_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    documented = documented_lines()
    support = trainer_support()
    declared = set(registry.declared_names(registry.METHODS))  # not other tests' own methods
    assert declared <= set(support) == set(registered_methods())
    assert set(documented) == declared
    for name, line in support.items():
        if name not in declared:
            continue
        options = smoke_options(name)
        if line is not None:
            assert "\n" not in line and "ContinualTrainer" in line
            assert documented[name] == line
            with pytest.raises(TrainerRefusal) as refused:
                ForgettingControl(name, **options)
            assert str(refused.value) == line
            with pytest.raises(TrainerRefusal):
                with_method(Trainer, name, **options)
            continue
        assert documented[name].startswith("runs inside a trainer")
        control = ForgettingControl(name, probes=["copy"], probe_batch=8, **options)
        trainer = two_tasks(Trainer, control, tiny_model_dir, tmp_path / name)
        assert [r["task"] for r in control.history] == ["task-1", "cipher"], name
        assert all(r["steps"] == 2 for r in control.history), name
        assert control.history[-1]["kl_to_base"] > 0, f"{name}: the model never left the base"
        logged = {k for entry in trainer.state.log_history for k in entry}
        assert "forgetless/kl_to_base" in logged, name
        if control.method.uses(Capability.LOSS_TERMS):
            term = [
                e[f"forgetless/{name}"]
                for e in trainer.state.log_history
                if f"forgetless/{name}" in e
            ]
            assert term and max(term) > 0, f"{name}: its term, named as the method, never acted"
        assert math.isfinite(trainer.state.log_history[-2]["train_loss"]), name


def test_refusal_names_the_stage_and_the_way_out() -> None:
    methods = registered_methods()
    assert refusal(methods["ewc"]) is None
    line = refusal(methods["anchored"])
    assert line is not None and "outer loop" in line
    assert line.endswith("run it with forgetless.ContinualTrainer(..., method='anchored')")


def test_a_bad_method_name_or_option_is_one_line() -> None:
    from forgetless.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown method 'ewcc'; known: .*did you mean 'ewc'"):
        with_method(Trainer, "ewcc")
    with pytest.raises(ConfigError) as caught:
        with_method(Trainer, "ewc", lamda=5.0)
    assert str(caught.value) == (
        "method 'ewc': lamda: Extra inputs are not permitted; did you mean 'lam'?"
    )


class Recorder(TrainerCallback):
    """What every ``report_to`` integration receives: the dicts of ``on_log``."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.logs.append(dict(logs or {}))


def test_retention_and_kl_to_the_base_reach_the_trainers_log(tmp_path: Path) -> None:
    recorder = Recorder()
    control = ForgettingControl("ewc", probes=["copy", "upper"], probe_batch=16, lam=1e3)
    trainer = two_tasks(
        Trainer, control, SHIPPED_BASE, tmp_path, steps=4, logging_steps=2, callbacks=[recorder]
    )
    logged = [entry for entry in recorder.logs if "forgetless/retention" in entry]
    assert len(logged) == 6  # two logging steps and the end, per task
    assert all(
        0 <= e["forgetless/retention"] <= 1 and e["forgetless/kl_to_base"] >= 0 for e in logged
    )
    assert {"forgetless/acc/copy", "forgetless/acc/upper"} <= set(logged[0])
    assert all(isinstance(e["forgetless/retention_unclipped"], float) for e in logged)
    assert any(e.get("forgetless/ewc", 0) > 0 for e in recorder.logs)  # task 2's penalty
    assert recorder.logs[-1] == {
        k: v for k, v in trainer.state.log_history[-1].items() if k != "step"
    }
    assert control.history[-1]["task"] == "cipher" and "retention" in control.history[-1]


def test_a_new_trainer_of_the_same_class_is_the_next_task_and_keeps_the_state(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    EWCTrainer = with_method(Trainer, "ewc", lam=1e4, fisher_samples=8)
    args = arguments(Trainer, tmp_path, steps=3)
    for name in ("reverse", "cipher"):
        data = features(tokenizer, name, 16)
        trainer = EWCTrainer(**trainer_kwargs(Trainer, model, tokenizer, args, data))
        trainer.train()
    control = trainer.forgetting
    assert control is EWCTrainer.forgetting and len(control.history) == 1  # task 1 ended
    assert set(control.method.fisher) == {n for n, p in model.named_parameters()}
    assert trainer.state.log_history[-1]["train_loss"] > 0
    penalty = [e["forgetless/ewc"] for e in trainer.state.log_history if "forgetless/ewc" in e]
    assert penalty and penalty[-1] > 0
    state = control.state_dict()
    again = ForgettingControl("ewc")
    again.load_state_dict(state)
    assert again.names == ["task-1", "task-2"]
    assert all(torch.equal(again.method.fisher[n], f) for n, f in control.method.fisher.items())


def test_the_budget_checks_steers_and_rolls_back_from_the_callback(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A KL budget no step can keep: every check is over it, so each puts the weights back to
    the task's start and strengthens λ, and the task ends where it began, as in a run."""
    budget = {"metric": "kl_to_base", "max_loss": 1e-9, "check_every": 2, "probe_batch": 8}
    control = ForgettingControl("ewc", probes=["copy"], budget=budget, lam=100.0, fisher_samples=4)
    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    args = arguments(Trainer, tmp_path, steps=4, logging_steps=2)
    data = features(tokenizer, "reverse", 16)
    trainer = with_method(Trainer, control)(**trainer_kwargs(Trainer, model, tokenizer, args, data))
    trainer.train()
    trainer.end_task()
    trace = control.history[0]["budget"]["trace"]
    assert [e["step"] for e in trace] == [2, 4] and all(e["rolled_back"] == 1.0 for e in trace)
    assert trace[-1]["next"] > trace[0]["value"] > 99  # λ strengthened at each check
    assert all(torch.equal(start[k], v) for k, v in model.state_dict().items())
    logged = [e for e in trainer.state.log_history if "forgetless/lam" in e]
    assert len(logged) == 2 and all(e["forgetless/rolled_back"] == 1.0 for e in logged)


@torch.no_grad()
def accuracy(model: Any, tokenizer: Any, task: Task) -> tuple[float, float]:
    """Exact match of the gold completion under teacher forcing (greedy decoding's verdict,
    ``forced_match``) and the share of gold tokens ranked first, on ``task``'s eval split."""
    logits, labels = teacher_forced_logits(model, teacher_forced_inputs(tokenizer, task.eval, 64))
    gold = labels[:, 1:]
    mask = gold != IGNORE_INDEX
    hit = (logits[:, :-1].argmax(-1) == gold) | ~mask
    return float(hit.all(1).float().mean()), float((hit & mask).sum() / mask.sum())


def after_two_tasks(seed: int, ewc: bool, out: Path) -> dict[str, float]:
    """reverse then cipher on the shipped tiny base (60 steps of 16 each, lr 1e-3), with EWC
    (λ 5e3) or without: each task's exact-match and token accuracy at the end."""
    tokenizer = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(SHIPPED_BASE))
    names = ("reverse", "cipher")
    tasks = [build_builtin_task(n, n_train=256, n_eval=64, seed=seed) for n in names]
    data = [[encode_example(tokenizer, e, MAX_LENGTH) for e in t.train] for t in tasks]
    args = arguments(Trainer, out, steps=60, per_device_train_batch_size=16, seed=seed)
    kw = trainer_kwargs(Trainer, model, tokenizer, args, data[0])
    if ewc:
        trainer = with_method(Trainer, "ewc", lam=5e3, fisher_samples=64)(**kw)
        trainer.train()
        trainer.next_task(data[1])
        trainer.train()
    else:
        Trainer(**kw).train()
        Trainer(**{**kw, "train_dataset": data[1]}).train()
    out_row: dict[str, float] = {}
    for name, task in zip(names, tasks, strict=True):
        out_row[name], out_row[f"{name}_tokens"] = accuracy(model, tokenizer, task)
    return out_row


def test_ewc_through_the_trainer_keeps_more_of_task_1_than_the_plain_trainer(
    tmp_path: Path,
) -> None:
    """Task-1 accuracy after task 2, EWC through the trainer minus the plain trainer, over three
    seeds: the 95% t-interval of the difference lies above zero."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [
            (after_two_tasks(s, False, tmp_path), after_two_tasks(s, True, tmp_path))
            for s in (0, 1, 2)
        ]
    finally:
        torch.set_num_threads(threads)
    for key in ("reverse", "reverse_tokens", "cipher", "cipher_tokens"):
        diff = mean_interval([ewc[key] - plain[key] for plain, ewc in runs])
        pairs = [(round(p[key], 3), round(e[key], 3)) for p, e in runs]
        print(f"{key}: EWC - plain = {diff} (plain, EWC per seed: {pairs})")
    gain = mean_interval([ewc["reverse"] - plain["reverse"] for plain, ewc in runs])
    assert gain is not None and gain.low > 0


def test_a_batch_taken_apart_and_collated_again_is_the_same_batch() -> None:
    feats = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = collate(feats, pad_id=0)
    assert uncollate(batch) == feats
    left = {k: v.flip(1) for k, v in batch.items()}  # left padding, rows reversed in time
    assert [f["input_ids"] for f in uncollate(left)] == [[7, 6, 5], [8]]
    with pytest.raises(forgetless.ConfigError, match="padding_free"):
        uncollate({"input_ids": batch["input_ids"], "labels": batch["labels"]})


def test_a_budget_needs_probes_and_a_knob() -> None:
    budget = {"metric": "kl_to_base", "max_loss": 0.1}
    with pytest.raises(forgetless.ConfigError, match="probes"):
        ForgettingControl("ewc", budget=budget)
    with pytest.raises(forgetless.ConfigError, match="no knob"):
        ForgettingControl("freeze", budget=budget, probes=["copy"])


def test_a_tokenizer_that_loses_text_is_warned_of_as_the_trainer_meets_it(
    tmp_path: Path,
) -> None:
    """transformers 5's AutoTokenizer loads the shipped base's generic tokenizer as
    Qwen2Tokenizer, which drops its spaces: the user hears of it before training."""
    from transformers import AutoTokenizer

    wrong = AutoTokenizer.from_pretrained(SHIPPED_BASE)
    model = AutoModelForCausalLM.from_pretrained(str(SHIPPED_BASE))
    data = features(build_char_tokenizer(), "reverse", 8)
    args = arguments(Trainer, tmp_path, steps=1)
    with pytest.warns(UserWarning, match=r"gives 'ab cd ef' back as 'abcdef'"):
        with_method(Trainer, "seq_ft")(**trainer_kwargs(Trainer, model, wrong, args, data))
