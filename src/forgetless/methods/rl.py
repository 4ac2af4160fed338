"""RL post-training of each task with Dr.GRPO (through TRL's ``GRPOTrainer``), SFT first."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn
from transformers import PrinterCallback, TrainerCallback

from forgetless.contract.hooks import Stage
from forgetless.contract.method import Capability, Method, MethodConfig, declare_method
from forgetless.contract.plan import TrainStats
from forgetless.core.fields import Count, NonNegative, Positive
from forgetless.engine.loop import steps_for_epochs
from forgetless.engine.resources import peak_memory_mb
from forgetless.errors import ConfigError
from forgetless.methods.papers import cite
from forgetless.models.finetuner import peft_quiet
from forgetless.tasks.base import Scorer, Task

EPOCHS_DIR = "epochs"
_DR_GRPO = "Dr.GRPO (Liu et al. 2025, 'Understanding R1-Zero-Like Training')"


class RLConfig(MethodConfig):
    name: Literal["rl"] = "rl"
    """SFT then Dr.GRPO on each task."""
    sft_first: bool = True
    """Train the task by SFT (the task's own train plan, through the shared loop) before RL on the
    same task: base → SFT → RL, as in the circuit-retention paper (shared/papers/000). false: RL
    only, from the model the task is given."""
    rl_epochs: Positive = 1.0
    """Passes of RL over the task's training prompts (the paper runs 2 epochs); ignored when
    rl_steps is set."""
    rl_steps: Count | None = None
    """RL optimizer steps in all, overriding rl_epochs."""
    rl_prompts: Count | None = None
    """Use only the first N training prompts for RL (default: all)."""
    prompts_per_step: Count = 8
    """Prompts per RL step; each is sampled group_size times."""
    group_size: int = Field(
        8, ge=2, description=f"G, completions sampled per prompt (the group). {_DR_GRPO} uses 8."
    )
    max_completion_length: Count | None = None
    """Generation length of a completion in tokens (default: the task's max_new_tokens); also the
    Dr.GRPO loss's constant normaliser."""
    temperature: Positive = 1.0
    """Sampling temperature of the rollouts."""
    rl_lr: Positive | None = None
    """RL learning rate (default: the task's SFT learning rate)."""
    beta: NonNegative = Field(
        0.0,
        description=f"Weight of the KL penalty to the model RL starts from. 0 in {_DR_GRPO}.",
    )
    epsilon: Positive = 0.2
    """PPO clipping range of the ratio (TRL default)."""
    partial_credit: float = Field(0.0, ge=0, lt=1)
    """Reward of a wrong answer: this weight times the share of reference characters matched at the
    same position (the built-in tasks score exact match only, so 0 keeps the scorer's 0/1 reward,
    as in the paper). Toolkit option."""
    save_epochs: bool = True
    """Save the model (a Hugging Face folder) at the task's start and after each SFT and RL epoch,
    under OUT/epochs/task-NN-NAME/{start,sft-epoch-E,rl-epoch-E}: the checkpoints `forgetless
    diagnose circuits` compares."""


def char_agreement(prediction: str, reference: str) -> float:
    """Share of positions where the two stripped strings agree, over the longer length."""
    pred, ref = prediction.strip(), reference.strip()
    width = max(len(pred), len(ref))
    if width == 0:
        return 1.0
    return sum(a == b for a, b in zip(pred, ref, strict=False)) / width


def task_reward(scorer: Scorer, partial_credit: float = 0.0) -> Callable[..., list[float]]:
    """A TRL reward function: 1 when the task's scorer accepts the completion, else
    ``partial_credit`` × :func:`char_agreement` (0 by default). References come from the
    dataset's ``reference`` column, which TRL passes as a keyword."""

    def reward(completions: list[Any], reference: list[str], **_: Any) -> list[float]:
        out = []
        for completion, ref in zip(completions, reference, strict=True):
            text = completion if isinstance(completion, str) else completion[-1]["content"]
            ok = scorer(text, ref)
            out.append(1.0 if ok else partial_credit * char_agreement(text, ref))
        return out

    reward.__name__ = "task_reward"
    return reward


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Â_i = r_i − mean(r of its group): Dr.GRPO's advantage, without GRPO's division by the
    group's standard deviation (Liu et al. 2025, Sec. 3.1). ``rewards`` is grouped contiguously."""
    grouped = rewards.view(-1, group_size)
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)


def dr_grpo_loss(
    per_token_loss: torch.Tensor, mask: torch.Tensor, max_completion_length: int
) -> torch.Tensor:
    """Dr.GRPO's aggregation: Σ masked token losses / (batch size × max completion length), a
    constant normaliser instead of GRPO's per-sequence length mean (Liu et al. 2025, Eq. 3)."""
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)


def prompt_records(task: Task, tokenizer: Any, limit: int | None) -> list[dict[str, Any]]:
    """The task's training prompts as TRL rows: plain text, or one user turn for chat models."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    rows = []
    for example in task.train[:limit]:
        prompt: Any = example.prompt
        if chat:
            prompt = list(example.messages[:-1]) if example.messages else None
            prompt = prompt or [{"role": "user", "content": example.prompt}]
        rows.append({"prompt": prompt, "reference": example.completion})
    return rows


def save_model_dir(model: nn.Module, tokenizer: Any, folder: Path) -> Path:
    """A Hugging Face folder of ``model`` (LoRA adapters merged into a copy first)."""
    folder.mkdir(parents=True, exist_ok=True)
    target: Any = model
    if hasattr(model, "merge_and_unload"):
        target = copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]
    target.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def _import_trl() -> Any:
    try:
        import trl
    except ImportError:
        raise ConfigError(
            "method rl needs TRL: pip install 'forgetless[rl]' (or pip install trl)"
        ) from None
    return trl


@declare_method(RLConfig, capabilities={Capability.TRAIN_STAGE}, paper=cite("rl_circuits"))
class RL(Method[RLConfig]):
    """Base → SFT → RL per task, after "Mechanistic origins of catastrophic forgetting: why RL
    preserves circuits better than SFT?" (summary in shared/papers/000): SFT through the shared
    loop (optional), then Dr.GRPO (Liu et al. 2025) with TRL's ``GRPOTrainer``
    (``loss_type="dr_grpo"``, ``scale_rewards="none"``: no per-group std scaling, a constant
    length normaliser). The reward is the task's scorer on the sampled completion. Each SFT and
    RL epoch can be saved as a model folder for circuit diagnosis.

    SFT epochs are separate ``stage.sft`` calls (one epoch each, data reshuffled per epoch), so
    AdamW's moments restart at each epoch boundary. With ``beta > 0`` TRL loads its reference by
    ``name_or_path``: the model RL starts from is saved first and the config pointed there
    (under LoRA TRL copies the ``default`` adapter as the reference; the copy is dropped after).
    """

    smoke: ClassVar[dict[str, Any]] = {
        "rl_steps": 2,
        "prompts_per_step": 2,
        "group_size": 2,
        "beta": 0.1,
    }
    unquantized = "merges the adapters into a copy of the base's weights for its RL stage"
    unsharded = (
        "trains through TRL's GRPOTrainer, which shards through accelerate's own FSDP "
        "preparation (GPU-family devices only), not on a model forgetless has already split"
    )

    unzeroed = "trains through TRL's GRPOTrainer, which prepares its own engine from the launch"

    def __init__(self, config: RLConfig) -> None:
        super().__init__(config)

    def train_task(self, stage: Stage) -> TrainStats:
        start, ctx = time.perf_counter(), stage.ctx
        trl = _import_trl()  # fail before any training when TRL is missing
        folder = stage.out_dir / EPOCHS_DIR / f"task-{ctx.task_index:02d}-{ctx.task.name}"
        saved: list[str] = []
        if self.config.save_epochs:
            saved.append(str(save_model_dir(ctx.model, ctx.tokenizer, folder / "start")))
        sft = self._sft(stage, folder, saved) if self.config.sft_first else []
        rl_stats, rl_details = self._rl(stage, trl, folder, saved)
        steps = sum(s.steps for s in sft) + rl_stats["steps"]
        terms = {"rl_loss": rl_stats["loss"], "reward": rl_stats["reward"]}
        if sft:
            terms["sft"] = sum(s.loss_terms.get("task", 0.0) * s.steps for s in sft) / sum(
                s.steps for s in sft
            )
        return TrainStats(
            steps=steps,
            seconds=time.perf_counter() - start,
            tokens=sum(s.tokens for s in sft) + rl_stats["tokens"],
            final_loss=rl_stats["loss"],
            loss_terms=terms,
            peak_memory_mb=peak_memory_mb(),
            details={
                "sft_epochs": [{"epoch": i + 1, **s.as_dict()} for i, s in enumerate(sft)],
                "rl": rl_details,
                "checkpoints": saved,
            },
        )

    def _sft(self, stage: Stage, folder: Path, saved: list[str]) -> list[TrainStats]:
        """The task's SFT plan, one ``stage.sft`` call per epoch (the last one may be partial)."""
        ctx, plan = stage.ctx, stage.plan
        per_epoch = steps_for_epochs(len(ctx.train_features), plan.batch_size, plan.grad_accum, 1)
        out: list[TrainStats] = []
        done = 0
        while done < plan.steps:
            steps = min(per_epoch, plan.steps - done)
            order = torch.randperm(
                len(ctx.train_features),
                generator=torch.Generator().manual_seed(plan.seed * 31 + len(out)),
            )
            features = [ctx.train_features[i] for i in order.tolist()]
            out.append(stage.sft(features=features, steps=steps, label=f"sft {len(out) + 1}"))
            done += steps
            if self.config.save_epochs:
                path = folder / f"sft-epoch-{len(out)}"
                saved.append(str(save_model_dir(ctx.model, ctx.tokenizer, path)))
        return out

    def _rl(
        self, stage: Stage, trl: Any, folder: Path, saved: list[str]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        cfg, ctx = self.config, stage.ctx
        rows = prompt_records(ctx.task, ctx.tokenizer, cfg.rl_prompts)
        if not rows:
            raise ConfigError(f"method rl: task {ctx.task.name!r} has no training prompts")
        per_epoch = max(1, math.ceil(len(rows) / cfg.prompts_per_step))
        total = cfg.rl_steps or max(1, math.ceil(per_epoch * cfg.rl_epochs))
        work = stage.out_dir / "rl" / folder.name
        model, name_or_path = ctx.model, None
        peft = getattr(model, "peft_config", None)
        if cfg.beta > 0 and peft is not None and "default" not in peft:
            raise ConfigError("method rl: beta > 0 under LoRA needs the carry or merge regime")
        if cfg.beta > 0 and peft is None:
            # TRL rebuilds its reference from config.name_or_path: point it at this very model.
            name_or_path = model.config._name_or_path  # type: ignore[union-attr]
            ref = save_model_dir(model, ctx.tokenizer, work / "reference")
            model.config._name_or_path = str(ref)  # type: ignore[union-attr]
        args = trl.GRPOConfig(**self._trainer_args(stage, work, total))
        callback = _EpochSaver(per_epoch, total, folder, ctx.tokenizer, cfg.save_epochs, saved)
        from datasets import Dataset

        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=task_reward(ctx.task.scorer, cfg.partial_credit),
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=copy.deepcopy(ctx.tokenizer),
            callbacks=[callback],
        )
        trainer.remove_callback(PrinterCallback)  # the runner reports progress itself
        try:
            with peft_quiet():  # TRL's trainer reads the deprecated flag on a PeftModel
                output = trainer.train()
        finally:
            if name_or_path is not None:
                model.config._name_or_path = name_or_path  # type: ignore[union-attr]
            if peft is not None and "ref" in peft:  # TRL's frozen copy of the adapter
                model.delete_adapter("ref")  # type: ignore[operator]
        model.eval()
        logs = [h for h in trainer.state.log_history if "loss" in h and "reward" in h]
        n = max(len(logs), 1)
        stats = {
            "steps": int(output.global_step),
            "loss": float(output.training_loss),
            "reward": sum(float(h["reward"]) for h in logs) / n,
            "tokens": int(logs[-1].get("num_tokens", 0)) if logs else 0,
        }
        details = {
            "steps": stats["steps"],
            "steps_per_epoch": per_epoch,
            "prompts": len(rows),
            "loss_type": args.loss_type,
            "scale_rewards": args.scale_rewards,
            "beta": args.beta,
            "group_size": cfg.group_size,
            "max_completion_length": args.max_completion_length,
            "reward_per_epoch": callback.rewards,
            "reward_first": float(logs[0]["reward"]) if logs else None,
            "reward_last": float(logs[-1]["reward"]) if logs else None,
        }
        return stats, details

    def _trainer_args(self, stage: Stage, work: Path, total: int) -> dict[str, Any]:
        cfg, ctx, plan = self.config, stage.ctx, stage.plan
        return {
            "output_dir": str(work),
            "loss_type": "dr_grpo",
            "scale_rewards": "none",
            "beta": cfg.beta,
            "epsilon": cfg.epsilon,
            "num_generations": cfg.group_size,
            "per_device_train_batch_size": cfg.group_size * cfg.prompts_per_step,
            "gradient_accumulation_steps": 1,
            "max_completion_length": cfg.max_completion_length or ctx.task.max_new_tokens,
            "temperature": cfg.temperature,
            "learning_rate": cfg.rl_lr or plan.lr,
            "lr_scheduler_type": "constant",
            "weight_decay": plan.weight_decay,
            "max_grad_norm": plan.max_grad_norm or 1e9,
            "max_steps": total,
            "gradient_checkpointing": False,  # TRL's default recomputes; not needed here
            "seed": plan.seed,
            "data_seed": plan.seed,
            "use_cpu": ctx.device.type == "cpu",
            "save_strategy": "no",
            "logging_steps": 1,
            "report_to": "none",
            "disable_tqdm": True,
        }


class _EpochSaver(TrainerCallback):
    """Saves the model after every RL epoch and records each epoch's mean reward."""

    def __init__(
        self, per_epoch: int, total: int, folder: Path, tokenizer: Any, save: bool, saved: list[str]
    ) -> None:
        self.per_epoch, self.total, self.folder = per_epoch, total, folder
        self.tokenizer, self.save, self.saved = tokenizer, save, saved
        self.rewards: list[float] = []
        self._window: list[float] = []

    def _epoch_end(self, step: int) -> bool:
        return step % self.per_epoch == 0 or step == self.total

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if self.save and model is not None and self._epoch_end(state.global_step):
            epoch = math.ceil(state.global_step / self.per_epoch)
            path = self.folder / f"rl-epoch-{epoch}"
            self.saved.append(str(save_model_dir(model, self.tokenizer, path)))

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        logs = kwargs.get("logs") or {}
        if "reward" not in logs:
            return
        self._window.append(float(logs["reward"]))
        if self._epoch_end(state.global_step):
            self.rewards.append(sum(self._window) / len(self._window))
            self._window = []
