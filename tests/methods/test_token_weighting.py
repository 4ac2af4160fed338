"""DFT, ASFT and EAFT: the losses against hand-written references of their published formulas,
their reductions at α = 0, a tiny run of each, and ASFT's adapter-free reference under LoRA."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import moved_lora, tiny_run_config
from peft import LoraConfig, get_peft_model
from rich.console import Console
from transformers import AutoModelForCausalLM

from forgetless.config.loading import validate_config
from forgetless.contract.method import Capability, StepContext, create_method, method_class
from forgetless.engine.loop import StepLoop
from forgetless.methods.asft import ASFT, ASFTConfig
from forgetless.methods.token_weighting import asft_loss, dft_loss, eaft_loss
from forgetless.tasks.formatting import IGNORE_INDEX, collate, completion_window
from forgetless.testing import task_context
from forgetless.training.runner import Runner

V = 7
_ = IGNORE_INDEX
LABELS = torch.tensor([[_, 3, 1, _, 6], [_, _, 2, 0, 4]])
"""Six scored tokens of the eight next-token positions (prompts and a gap are -100)."""


def fixed_logits(seed: int) -> torch.Tensor:
    return 3.0 * torch.randn(2, 5, V, generator=torch.Generator().manual_seed(seed))


LOGITS, REF = fixed_logits(0), fixed_logits(1)

PerToken = Callable[[list[float], list[float], int], float]
"""A token's loss from the model's next-token probabilities, the reference's, and the target."""


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    return [e / sum(exps) for e in exps]


def by_hand(per_token: PerToken, num_items: int | None = None) -> float:
    """Σ over scored tokens of ``per_token``, over ``num_items`` or the scored tokens."""
    total, scored = 0.0, 0
    for b in range(LABELS.size(0)):
        for t in range(LABELS.size(1) - 1):
            target = int(LABELS[b, t + 1])
            if target == IGNORE_INDEX:
                continue
            p, q = softmax(LOGITS[b, t].tolist()), softmax(REF[b, t].tolist())
            total, scored = total + per_token(p, q, target), scored + 1
    return total / (num_items if num_items is not None else scored)


def dft_token(p: list[float], q: list[float], y: int) -> float:
    return p[y] * -math.log(p[y])


def forward_kl_token(p: list[float], q: list[float], y: int) -> float:
    return sum(qv * math.log(qv / pv) for pv, qv in zip(p, q, strict=True))


def k3_token(p: list[float], q: list[float], y: int) -> float:
    """NeMo-RL's k3 with its clamps: |log ratio| ≤ 20, the value ≤ 10 (these logits reach it)."""
    log_ratio = min(max(math.log(q[y] / p[y]), -20.0), 20.0)
    return min(math.exp(log_ratio) - 1 - log_ratio, 10.0)


def eaft_token(alpha: float, k: int) -> PerToken:
    def token(p: list[float], q: list[float], y: int) -> float:
        top = sorted(p)[-k:]
        entropy = -sum(x / sum(top) * math.log(x / sum(top)) for x in top)
        return (entropy / math.log(k)) ** alpha * -math.log(p[y])

    return token


def close(actual: torch.Tensor, expected: float) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize("num_items", [None, 9, torch.tensor(12)])
def test_dft_is_the_probability_weighted_cross_entropy(num_items: Any) -> None:
    n = None if num_items is None else int(num_items)
    close(dft_loss(LOGITS, LABELS, num_items), by_hand(dft_token, n))


@pytest.mark.parametrize("num_items", [None, 9])
@pytest.mark.parametrize(
    ("direction", "kl_token"), [("forward", forward_kl_token), ("reverse", k3_token)]
)
def test_asft_is_dft_plus_alpha_times_the_kl_in_either_direction(
    direction: Any, kl_token: PerToken, num_items: int | None
) -> None:
    expected = by_hand(lambda p, q, y: dft_token(p, q, y) + 0.3 * kl_token(p, q, y), num_items)
    close(asft_loss(LOGITS, REF, LABELS, 0.3, direction, num_items), expected)


@pytest.mark.parametrize("num_items", [None, 9])
@pytest.mark.parametrize(("alpha", "k"), [(1.0, 20), (0.7, 4), (2.0, 2)])
def test_eaft_weights_by_the_normalised_top_k_entropy(
    alpha: float, k: int, num_items: int | None
) -> None:
    expected = by_hand(eaft_token(alpha, min(k, V)), num_items)
    close(eaft_loss(LOGITS, LABELS, alpha, k, num_items), expected)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_asft_at_alpha_zero_is_dft(direction: Any) -> None:
    torch.testing.assert_close(
        asft_loss(LOGITS, REF, LABELS, 0.0, direction, 9), dft_loss(LOGITS, LABELS, 9)
    )


def test_eaft_at_alpha_zero_is_plain_cross_entropy() -> None:
    plain = F.cross_entropy(LOGITS[:, :-1].reshape(-1, V), LABELS[:, 1:].reshape(-1))
    torch.testing.assert_close(eaft_loss(LOGITS, LABELS, 0.0), plain, atol=1e-6, rtol=0)


def test_the_weights_scale_the_gradient_but_are_not_trained() -> None:
    """DFT's gradient is the cross-entropy's scaled by the (constant) probability of each target."""
    logits = LOGITS.clone().requires_grad_()
    dft_loss(logits, LABELS).backward()
    held = LOGITS.clone().requires_grad_()
    flat = held[:, :-1][LABELS[:, 1:] != IGNORE_INDEX]
    nll = F.cross_entropy(flat, LABELS[:, 1:][LABELS[:, 1:] != IGNORE_INDEX], reduction="none")
    (nll * torch.exp(-nll).detach()).mean().backward()
    torch.testing.assert_close(logits.grad, held.grad)


def test_no_scored_token_gives_an_attached_zero() -> None:
    logits = LOGITS.clone().requires_grad_()
    none = torch.full_like(LABELS, IGNORE_INDEX)
    for loss in (
        dft_loss(logits, none),
        eaft_loss(logits, none),
        asft_loss(logits, REF, none, 0.1, "reverse"),
    ):
        assert loss.item() == 0.0 and loss.requires_grad


NAMES = ("seq_ft", "dft", "eaft", "asft")


def first_step_task_loss(model_dir: Path, out: Path, name: str, finetune: str) -> float:
    """The task loss of a one-step, one-task run: the method's loss at the base weights."""
    raw = tiny_run_config(
        model_dir,
        tasks=["reverse"],
        method={"name": name},
        finetune={"mode": finetune, "lora": {"r": 2}},
        train={"steps": 1, "batch_size": 8, "lr": 1e-3, "max_length": 32},
    )
    results = Runner(validate_config(raw), out, Console(quiet=True), progress=False).run()
    record = results.to_json()
    assert record["status"] == "complete"
    return float(record["per_task"][0]["loss_terms"]["task"])


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_each_replaces_the_task_loss_of_a_run(
    finetune: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """On the same first batch at the base weights: DFT and EAFT weigh every token's loss by at
    most 1, so they are below plain SFT's; ASFT's anchor is 0 at the base (its reference), so it
    equals DFT, under LoRA too (the adapter-free model)."""
    task = {n: first_step_task_loss(tiny_model_dir, tmp_path / n, n, finetune) for n in NAMES}
    assert task["dft"] < task["seq_ft"] and task["eaft"] < task["seq_ft"]
    assert task["dft"] != pytest.approx(task["eaft"])
    assert task["asft"] == pytest.approx(task["dft"], abs=1e-6)


def _never_load() -> Any:
    raise AssertionError("under LoRA, ASFT must not load a second copy of the base")


def test_asft_under_lora_anchors_to_the_adapter_free_model(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    lora.train()
    ctx = task_context(lora, ["reverse"], n_train=4, finetune_mode="lora", lora_regime="carry")
    ctx.run.load_base = _never_load
    method = ASFT(ASFTConfig(alpha=1.0))
    method.on_task_start(ctx)
    assert method.reference.copy is None and method.reference.adapter_free
    batch = collate(ctx.train_features, ctx.tokenizer.pad_token_id)
    step = StepContext(ctx, 0, 1)
    labels = batch["labels"]

    def loss() -> tuple[torch.Tensor, torch.Tensor]:
        out = lora(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return method.task_loss(batch, out, step), out.logits

    at_init, logits = loss()  # the adapters' B is zero: the model is the base
    torch.testing.assert_close(at_init, dft_loss(logits, labels), atol=1e-7, rtol=0)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param), alpha=0.5)
    moved, logits = loss()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    with torch.no_grad():
        base_logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    expected = asft_loss(logits, base_logits.logits, labels, 1.0)
    torch.testing.assert_close(moved, expected, atol=1e-6, rtol=0)
    assert moved.item() > dft_loss(logits, labels).item() + 1e-4  # a real anchor now
    assert lora.training  # the reference pass leaves the model's mode as it was


def test_asft_loads_the_base_where_the_adapters_are_folded_in(tiny_model_dir: Path) -> None:
    """The merge regime folds each task's adapter into the weights: switching the adapters off
    no longer gives the base, so the base is loaded."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    ctx = task_context(lora, ["reverse"], n_train=4, finetune_mode="lora", lora_regime="merge")
    loads: list[str] = []

    def load_base() -> Any:
        loads.append("base")
        return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))

    ctx.run.load_base = load_base
    method = ASFT(ASFTConfig())
    method.on_task_start(ctx)
    assert loads == ["base"] and method.reference.copy is not None
    assert not method.reference.adapter_free


@pytest.mark.parametrize("name", ["dft", "asft", "eaft"])
def test_the_loop_gives_the_completion_window_and_the_loss_is_unchanged(
    name: str, tiny_model_dir: Path
) -> None:
    torch.manual_seed(0)
    lora = moved_lora(tiny_model_dir)
    ctx = task_context(lora, ["reverse"], n_train=4, finetune_mode="lora", lora_regime="carry")
    method = create_method(method_class(name).config_cls.model_validate({}))
    if method.uses(Capability.TASK_START):
        method.on_task_start(ctx)
    assert StepLoop(lora, method, ctx, ctx.tokenizer.pad_token_id)._windowed(None)
    batch = collate(ctx.train_features, ctx.tokenizer.pad_token_id)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    keep = completion_window(batch["labels"])
    assert keep < batch["input_ids"].shape[1]
    step = StepContext(ctx, 0, 1)
    full = method.task_loss(batch, lora(**inputs), step)
    windowed = method.task_loss(batch, lora(**inputs, logits_to_keep=keep), step)
    torch.testing.assert_close(windowed, full, atol=1e-6, rtol=0)
