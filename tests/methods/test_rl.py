"""The rl method: Dr.GRPO's loss and advantages through TRL's own code, rewards, epoch saves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from forgetless.config.loading import validate_config
from forgetless.methods.rl import (
    EPOCHS_DIR,
    char_agreement,
    dr_grpo_advantages,
    dr_grpo_loss,
    task_reward,
)
from forgetless.tasks.base import exact_match
from forgetless.training.runner import Runner

trl = pytest.importorskip("trl")


def _parity(prediction: str, reference: str) -> bool:
    """A scorer that a random model passes about half the time (varied rewards in a group)."""
    return sum(map(ord, prediction)) % 2 == 0


def _trainer(
    model_dir: Path, tmp_path: Path, group: int = 4, length: int = 5, scorer: Any = exact_match
) -> Any:
    from datasets import Dataset

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = [{"prompt": f"rev {w}=", "reference": w[::-1]} for w in ("abc", "xyz")]
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        loss_type="dr_grpo",
        scale_rewards="none",
        beta=0.0,
        num_generations=group,
        per_device_train_batch_size=2 * group,
        max_completion_length=length,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    reward = task_reward(scorer, partial_credit=0.5)
    return trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )


def test_dr_grpo_loss_equals_its_formula(tiny_model_dir: Path, tmp_path: Path) -> None:
    """TRL's compute_loss on a crafted batch = Σ masked clipped token losses / (B × L_max)."""
    trainer, length = _trainer(tiny_model_dir, tmp_path, length=6), 6
    model = trainer.model.eval()  # eval: no gradient-accumulation division
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(4, 60, (4, 3), generator=g)
    completion_ids = torch.randint(4, 60, (4, 4), generator=g)  # shorter than L_max on purpose
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    advantages = torch.tensor([0.7, -0.3, 0.1, -0.5])
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)
    with torch.no_grad():  # the per-token log-probs exactly as TRL computes them
        logp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, 4)
    old = logp + torch.linspace(-0.4, 0.4, logp.numel()).view_as(logp)  # ratios in and out of clip
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "num_items_in_batch": completion_mask.sum(),
    }
    with torch.no_grad():
        got = trainer.compute_loss(model, inputs)
    ratio = torch.exp(logp - old)
    adv = advantages[:, None]
    token_loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    expected = (token_loss * completion_mask).sum() / (4 * length)
    assert torch.allclose(got, expected, atol=1e-6), (got.item(), expected.item())
    assert torch.allclose(dr_grpo_loss(token_loss, completion_mask, length), expected)
    mean_of_means = ((token_loss * completion_mask).sum(1) / completion_mask.sum(1)).mean()
    assert not torch.allclose(got, mean_of_means, atol=1e-4), "must not be GRPO's length mean"


def test_advantages_are_reward_minus_group_mean(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Our reward through TRL's rollout: Â = r − group mean, no division by the group's std."""
    group = 4
    trainer = _trainer(tiny_model_dir, tmp_path, group=group, scorer=_parity)
    trainer.model.train()
    rows = [{"prompt": "rev abc=", "reference": "cba"}] * group
    rows += [{"prompt": "rev xyz=", "reference": "zyx"}] * group
    torch.manual_seed(3)
    out = trainer._generate_and_score_completions(rows)
    texts = trainer.processing_class.batch_decode(out["completion_ids"], skip_special_tokens=True)
    rewards = torch.tensor(
        task_reward(_parity, 0.5)(texts, [r["reference"] for r in rows]), dtype=torch.float32
    )
    assert rewards.std() > 0, "the test needs different rewards in a group"
    assert torch.allclose(out["advantages"], dr_grpo_advantages(rewards, group), atol=1e-6)


def test_rewards_and_partial_credit() -> None:
    assert char_agreement("cba", "cba") == 1.0
    assert char_agreement("cbx", "cba") == pytest.approx(2 / 3)
    assert char_agreement("cb", "cba") == pytest.approx(2 / 3)
    assert char_agreement("", "") == 1.0
    reward = task_reward(exact_match, partial_credit=0.5)
    assert reward(["cba ", "cbx", "zzz"], ["cba", "cba", "cba"]) == pytest.approx([1.0, 1 / 3, 0])
    assert task_reward(exact_match)(["cbx"], ["cba"]) == [0.0]
    chat = [[{"role": "assistant", "content": "ok"}]]
    assert task_reward(exact_match)(chat, ["ok"]) == [1.0]
    adv = dr_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0]), 3)
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -4 / 3, 2 / 3, 2 / 3]))


def test_sft_then_rl_saves_every_epoch(tiny_model_dir: Path, tmp_path: Path) -> None:
    """base → SFT (2 epochs) → RL (2 epochs), one model folder per epoch; RL moves weights."""
    raw = tiny_run_config(
        tiny_model_dir,
        tasks=["count"],  # one-digit answers: after a little SFT some samples are right
        probes=[],
        eval={"n_eval": 4, "n_train": 16, "batch_size": 8, "kl_drift": False},
        train={"epochs": 2, "batch_size": 8, "lr": 3e-3, "max_length": 32},
        method={
            "name": "rl",
            "rl_epochs": 2,
            "prompts_per_step": 8,
            "group_size": 4,
            "max_completion_length": 2,
            "partial_credit": 0.5,
        },
    )
    out = tmp_path / "run"
    result = Runner(validate_config(raw), out, Console(quiet=True), progress=False).run()
    folder = out / EPOCHS_DIR / "task-01-count"
    names = ["start", "sft-epoch-1", "sft-epoch-2", "rl-epoch-1", "rl-epoch-2"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)
    details = result.to_json()["per_task"][0]["details"]
    assert details["rl"]["loss_type"] == "dr_grpo" and details["rl"]["scale_rewards"] == "none"
    assert details["rl"]["steps"] == 4 and len(details["sft_epochs"]) == 2
    assert len(details["rl"]["reward_per_epoch"]) == 2
    assert max(details["rl"]["reward_per_epoch"]) > 0, "no reward: the test would prove nothing"
    weights = [
        AutoModelForCausalLM.from_pretrained(str(folder / n)).state_dict() for n in names[1:]
    ]
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), "SFT moved"
    assert any(not torch.equal(weights[1][k], weights[3][k]) for k in weights[1]), "RL moved"
