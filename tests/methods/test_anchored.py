"""Anchored Learning: the anchor and its bounds on random logits, the top-k cache, the stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from safetensors.torch import load_file

from forgetless.config.loading import validate_config
from forgetless.config.schema import ModelConfig
from forgetless.contract import registered_methods
from forgetless.contract.method import Capability, StepContext
from forgetless.errors import ConfigError
from forgetless.eval import metrics
from forgetless.eval.generation import shared_prefix
from forgetless.methods.anchored import (
    AnchorCache,
    Anchored,
    AnchoredConfig,
    anchor_loss,
    completion_logprobs,
    completion_mask,
)
from forgetless.methods.anchored_math import (
    anchor_logprobs,
    cache_bytes_per_token,
    cached_anchor_kl,
    kl_bound,
    kl_per_position,
    topk_anchor,
)
from forgetless.models.loading import load_model_and_tokenizer
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import collate, encode_example
from forgetless.testing import save_tiny
from forgetless.training.runner import Runner

F64 = torch.float64
ALPHAS = (0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99)


def random_pairs(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log p_θ and log p_sft on ``n`` cases, from flat to very peaked (temperatures e^±3)."""
    g = torch.Generator().manual_seed(seed)
    scale_t = torch.exp(torch.randn(n, 1, generator=g, dtype=F64) * 1.5)
    scale_s = torch.exp(torch.randn(n, 1, generator=g, dtype=F64) * 1.5)
    z_theta = torch.randn(n, vocab, generator=g, dtype=F64) * scale_t
    z_sft = torch.randn(n, vocab, generator=g, dtype=F64) * scale_s
    return z_theta.log_softmax(-1), z_sft.log_softmax(-1)


def ratios(kl: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    keep = bound > 1e-12  # identical pairs: both sides are 0 up to rounding
    return kl[keep] / bound[keep]


@pytest.mark.parametrize("space", ["prob", "logit"])
def test_both_bounds_hold_on_thousands_of_random_cases(space: str) -> None:
    worst = 0.0
    for seed, vocab in enumerate((2, 7, 50)):
        logp_theta, logp_sft = random_pairs(4000, vocab, seed)
        for alpha in ALPHAS:
            logq = anchor_logprobs(logp_theta, logp_sft, alpha, space)  # type: ignore[arg-type]
            kl = kl_per_position(logq, logp_theta)
            bound = kl_bound(logp_theta, logp_sft, alpha, space)  # type: ignore[arg-type]
            assert bool((kl <= bound * (1 + 1e-9) + 1e-14).all()), (space, alpha, vocab)
            worst = max(worst, float(ratios(kl, bound).max()))
    # 3 vocabularies x 4000 cases x 7 alphas = 84,000 checks per space.
    assert worst <= 1.0 + 1e-9
    if space == "logit":
        assert worst < 0.99  # the logit bound is loose on these cases


def test_probability_bound_becomes_equality_as_alpha_goes_to_one() -> None:
    logp_theta, logp_sft = random_pairs(2000, 20, seed=7)
    medians = []
    for alpha in (0.1, 0.5, 0.9, 0.99, 0.999):
        logq = anchor_logprobs(logp_theta, logp_sft, alpha, "prob")
        r = ratios(kl_per_position(logq, logp_theta), kl_bound(logp_theta, logp_sft, alpha, "prob"))
        medians.append(float(r.median()))
        last_min = float(r.min())
    assert medians == sorted(medians), medians
    assert medians[-1] > 0.999 and last_min > 0.99, (medians, last_min)
    bound_at_one = kl_bound(logp_theta, logp_sft, 1.0, "prob")
    at_one = kl_per_position(anchor_logprobs(logp_theta, logp_sft, 1.0, "prob"), logp_theta)
    torch.testing.assert_close(at_one, bound_at_one, rtol=0, atol=0)
    assert bool(torch.isinf(kl_bound(logp_theta, logp_sft, 1.0, "logit")).all())


@pytest.mark.parametrize("space", ["prob", "logit"])
def test_alpha_one_is_the_reference_and_alpha_zero_the_student(space: Any) -> None:
    logp_theta, logp_sft = random_pairs(100, 13, seed=3)
    assert torch.equal(anchor_logprobs(logp_theta, logp_sft, 1.0, space), logp_sft)
    logq = anchor_logprobs(logp_theta, logp_sft, 0.0, space)
    assert torch.equal(logq, logp_theta)
    assert float(kl_bound(logp_theta, logp_sft, 0.0, space).abs().max()) == 0.0
    for k in (4, 13):
        logits = logp_theta.clone().requires_grad_()
        loss = cached_anchor_kl(logits.log_softmax(-1), *topk_anchor(logq, k)).sum()
        loss.backward()
        assert abs(float(loss.detach())) < 1e-12, k  # zero loss ...
        assert logits.grad is not None and float(logits.grad.abs().max()) < 1e-12  # ... no pull


def test_anchors_are_the_geometric_and_arithmetic_means() -> None:
    logp_theta, logp_sft = random_pairs(500, 9, seed=5)
    p_theta, p_sft = logp_theta.exp(), logp_sft.exp()
    geo = p_theta**0.7 * p_sft**0.3
    torch.testing.assert_close(
        anchor_logprobs(logp_theta, logp_sft, 0.3, "logit").exp(), geo / geo.sum(-1, keepdim=True)
    )
    torch.testing.assert_close(
        anchor_logprobs(logp_theta, logp_sft, 0.3, "prob").exp(), 0.7 * p_theta + 0.3 * p_sft
    )


def test_log_space_mixture_keeps_the_bound_on_peaked_float32() -> None:
    """Peaked float32 distributions: the log-space mixture stays finite and within its bound."""
    logp_theta, logp_sft = random_pairs(4000, 50, seed=11)
    lt, ls = (logp_theta * 8).log_softmax(-1).float(), (logp_sft * 8).log_softmax(-1).float()
    for alpha in (0.1, 0.5, 0.9):
        logq = anchor_logprobs(lt, ls, alpha, "prob")
        assert bool(torch.isfinite(logq).all())
        kl, bound = kl_per_position(logq, lt), kl_bound(lt, ls, alpha, "prob")
        assert bool((kl <= bound * (1 + 1e-4) + 1e-4).all()), alpha


def test_full_cache_is_exact_and_a_partial_one_a_lower_bound() -> None:
    logp_theta, logp_sft = random_pairs(3000, 40, seed=2)
    logq = anchor_logprobs(logp_theta, logp_sft, 0.5, "logit")
    values, indices, tail = topk_anchor(logq, 40)
    assert bool(torch.isinf(tail).all()) and values.shape == (3000, 40)
    exact_p = logp_theta.clone().requires_grad_()
    cached_p = logp_theta.clone().requires_grad_()
    exact = kl_per_position(logq, exact_p)
    cached = cached_anchor_kl(cached_p, values, indices, tail)
    torch.testing.assert_close(cached, exact, rtol=1e-12, atol=1e-14)
    exact.sum().backward()
    cached.sum().backward()
    torch.testing.assert_close(cached_p.grad, exact_p.grad, rtol=1e-12, atol=1e-14)
    # float32, the dtype training uses: the same to float32 rounding
    cached32 = cached_anchor_kl(logp_theta.float(), *topk_anchor(logq.float(), 64))
    torch.testing.assert_close(cached32, exact.detach().float(), rtol=1e-4, atol=1e-6)
    for k in (1, 5, 20):
        values, indices, tail = topk_anchor(logq, k)
        torch.testing.assert_close(
            tail.exp(), 1 - values.exp().sum(-1), rtol=1e-9, atol=1e-12
        )  # the tail is everything the top-k leaves
        partial = cached_anchor_kl(logp_theta, values, indices, tail)
        assert bool((partial <= exact.detach() + 1e-12).all()) and bool((partial >= -1e-12).all())
    assert cache_bytes_per_token(32, 99) == 32 * 6 + 4  # int16 ids for a small vocabulary
    assert cache_bytes_per_token(32, 151_936) == 32 * 8 + 4
    assert cache_bytes_per_token(500, 99) == 99 * 6 + 4


def test_cached_loss_on_a_model_batch_equals_the_uncached_kl(tiny_model_dir: Path) -> None:
    """The inner loss (k = vocab) on a real batch: same value and gradients as KL(q ‖ p_θ)."""
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    other, _ = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    task = build_builtin_task("reverse", n_train=6, n_eval=1, seed=0)
    feats = [{**encode_example(tokenizer, e, 32), "index": [i]} for i, e in enumerate(task.train)]
    order = [4, 1, 3]  # a batch out of dataset order: rows must follow batch["index"]
    full = collate(feats, tokenizer.pad_token_id)
    mask = completion_mask(full)
    with torch.no_grad():
        logits_t = model(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits
        logits_s = other(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits
    logq_all = anchor_logprobs(
        logits_t[:, :-1].log_softmax(-1), logits_s[:, :-1].log_softmax(-1), 0.5, "prob"
    )
    values, indices, tail = topk_anchor(logq_all[mask], 10_000)
    counts = mask.sum(1).tolist()
    offsets = [0, *torch.tensor(counts).cumsum(0).tolist()]
    cache = AnchorCache(values, indices.to(torch.int16), tail, offsets)
    batch = collate([feats[i] for i in order], tokenizer.pad_token_id)
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    cached = anchor_loss(cache)(batch, outputs, None)  # type: ignore[arg-type]
    (g_cached,) = torch.autograd.grad(cached, outputs.logits, retain_graph=True)
    logp = outputs.logits[:, :-1].log_softmax(-1)
    width = batch["input_ids"].size(1) - 1  # the sub-batch pads to its own longest example
    exact = metrics.token_kl(logq_all[order][:, :width], logp, completion_mask(batch))
    (g_exact,) = torch.autograd.grad(exact, outputs.logits)
    torch.testing.assert_close(cached, exact, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_cached, g_exact, rtol=1e-4, atol=1e-8)
    assert float(exact) > 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_anchor_logprobs_skip_the_prompt_and_match_the_full_forward(
    tmp_path: Path, arch: str
) -> None:
    """The anchor pass reads the completion window after a shared chat prefix run once: the
    same rows, in the same order, as the full forward's completion positions."""
    folder = save_tiny(tmp_path / arch, arch=arch, chat=True)
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(folder)))
    model.eval()
    task = build_builtin_task("reverse", n_train=6, n_eval=1, seed=0)
    batch = collate([encode_example(tokenizer, e, 64) for e in task.train], tokenizer.pad_token_id)
    assert shared_prefix(batch["input_ids"], batch["attention_mask"], 64) > 4
    with torch.no_grad():
        full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        widths: list[int] = []
        hook = model.lm_head.register_forward_hook(lambda m, a, out: widths.append(out.shape[1]))
        fast = completion_logprobs(model, batch)
        hook.remove()
    assert widths and max(widths) < batch["input_ids"].shape[1], "the prompt's logits are skipped"
    whole = full[:, :-1][completion_mask(batch)].float().log_softmax(-1)
    assert fast.shape == whole.shape
    torch.testing.assert_close(fast, whole, rtol=1e-4, atol=1e-4)


def test_config_defaults_and_validation() -> None:
    cfg = AnchoredConfig()
    assert (cfg.alpha, cfg.space, cfg.inner_epochs, cfg.outer_iterations) == (0.5, "logit", 5, 5)
    assert registered_methods()["anchored"] is Anchored
    assert Anchored.capabilities == frozenset({Capability.TRAIN_STAGE})
    with pytest.raises(ConfigError, match="alpha"):
        validate_config(tiny_run_config(Path("."), method={"name": "anchored", "alpha": 1.5}))
    with pytest.raises(ConfigError, match="space"):
        validate_config(tiny_run_config(Path("."), method={"name": "anchored", "space": "mean"}))


BUDGET = {"steps": 4, "batch_size": 8, "lr": 1e-2, "max_length": 32}
SMALL = {"name": "anchored", "outer_iterations": 2, "inner_steps": 3, "top_k": 8}


def run(model_dir: Path, out: Path, instance: Any = None, **overrides: Any) -> dict[str, Any]:
    cfg = validate_config(tiny_run_config(model_dir, **overrides))
    return Runner(cfg, out, Console(quiet=True), progress=False, method=instance).run().to_json()


@pytest.mark.parametrize("space", ["logit", "prob"])
def test_run_records_the_bound_step_and_residual_per_iteration(
    space: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    results = run(tiny_model_dir, tmp_path, method={**SMALL, "space": space}, train=BUDGET)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["per_task"] == json.loads(json.dumps(results["per_task"]))
    for stats in on_disk["per_task"]:
        details = stats["details"]
        assert stats["steps"] == 4 + 2 * 3, "the reference's plan steps, then T x inner steps"
        assert details["reference"]["steps"] == 4 and details["space"] == space
        assert details["cache_bytes_per_token"] == 8 * 6 + 4
        assert details["cache_bytes"] == details["cache_tokens"] * 52 > 0
        assert [it["t"] for it in details["iterations"]] == [1, 2]
        for it in details["iterations"]:
            assert set(it) >= {"bound", "anchor_kl", "step_kl", "residual_kl", "tail_mass"}
            assert 0 <= it["anchor_kl"] <= it["bound"] * (1 + 1e-5) + 1e-7
            assert it["step_kl"] > 0 and it["residual_kl"] >= 0 and it["inner_steps"] == 3
            assert 0 <= it["tail_mass"] < 1
        cost = details["cost"]
        assert cost["inner_steps"] == 6 and cost["reference_steps"] == 4
        assert cost["total_seconds"] + 0.01 >= cost["inner_seconds"] + cost["cache_seconds"]
        assert set(stats["loss_terms"]) == {"anchor_kl", "reference_sft"}


def test_a_drawn_pool_forms_each_anchor_over_its_inner_steps_examples(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """anchor_pool: drawn caches only the examples the anchor's inner steps draw (3 steps of 8
    here, of a larger task pool), a fresh draw per anchor, and the inner steps still run."""
    from forgetless.methods.anchored import drawn_pool

    order = [{"input_ids": [i], "index": [7 - i]} for i in range(8)]
    assert drawn_pool(order, 3) == [{"input_ids": [i], "index": [i]} for i in range(3)]
    method = {**SMALL, "anchor_pool": "drawn"}
    drawn = run(tiny_model_dir, tmp_path / "drawn", method=method, train=BUDGET)
    whole = run(tiny_model_dir, tmp_path / "task", method=SMALL, train=BUDGET)
    for mine, theirs in zip(drawn["per_task"], whole["per_task"], strict=True):
        tokens = mine["details"]["cache_tokens"]
        assert 0 < tokens < theirs["details"]["cache_tokens"]
        assert mine["details"]["cost"]["inner_steps"] == 6


def test_alpha_zero_leaves_the_weights_unchanged(tiny_model_dir: Path, tmp_path: Path) -> None:
    results = run(
        tiny_model_dir, tmp_path, method={**SMALL, "alpha": 0.0}, tasks=["reverse"], train=BUDGET
    )
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "checkpoints/task-01-reverse/model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in set(before) & set(after))
    assert results["per_task"][0]["steps"] == 0


def test_student_init_base_needs_full_fine_tuning(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="student_init"):
        run(
            tiny_model_dir,
            tmp_path,
            method={**SMALL, "student_init": "base"},
            finetune={"mode": "lora", "lora": {"r": 2}},
            tasks=["reverse"],
            train=BUDGET,
        )


class CrashAt(Anchored):
    """anchored that dies at a given task and inner step, as a killed process would."""

    capabilities = Anchored.capabilities | {Capability.BATCH_TRANSFORM}

    def __init__(self, task: int, step: int) -> None:
        super().__init__(AnchoredConfig.model_validate(SMALL))
        self.where = (task, step)

    def transform_batch(self, features: list[Any], ctx: StepContext) -> list[Any]:
        if (ctx.task.task_index, ctx.step) == self.where and "index" in features[0]:
            raise KeyboardInterrupt("simulated crash")
        return features


def test_resume_gives_the_same_matrix(tiny_model_dir: Path, tmp_path: Path) -> None:
    full = run(tiny_model_dir, tmp_path / "full", method=SMALL, train=BUDGET)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_model_dir, tmp_path / "crash", CrashAt(task=2, step=1), method=SMALL, train=BUDGET)
    assert json.loads((tmp_path / "crash/results.json").read_text())["completed_tasks"] == 1
    resumed = run(tiny_model_dir, tmp_path / "crash", method=SMALL, train=BUDGET)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["kl_drift"] == full["kl_drift"]
    assert (
        resumed["per_task"][1]["details"]["iterations"]
        == (full["per_task"][1]["details"]["iterations"])
    )
    a = load_file(str(tmp_path / "full/checkpoints/task-02-cipher/model.safetensors"))
    b = load_file(str(tmp_path / "crash/checkpoints/task-02-cipher/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_loaded_reference_and_no_measuring(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A reference loaded per task from a folder ({task} filled in): no reference training;
    measure: false records the bound and the anchor's KL only."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        for param in ref.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    ref.save_pretrained(str(tmp_path / "refs" / "reverse"))
    method = {**SMALL, "reference_path": str(tmp_path / "refs" / "{task}"), "measure": False}
    results = run(tiny_model_dir, tmp_path / "run", method=method, tasks=["reverse"], train=BUDGET)
    stats = results["per_task"][0]
    assert stats["steps"] == 2 * 3 and set(stats["loss_terms"]) == {"anchor_kl"}
    details = stats["details"]
    assert details["reference"]["loaded_from"] == str(tmp_path / "refs" / "reverse")
    for it in details["iterations"]:
        assert "step_kl" not in it and 0 < it["anchor_kl"] <= it["bound"]
