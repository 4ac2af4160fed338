"""SDFT: on-policy self-distillation from demonstrations (Shenfeld et al. 2026, arXiv:2601.19897).

Each step the student samples a completion of every training prompt; a teacher, the same network
given the prompt *with the example's demonstration in context*, scores those very tokens; the
loss is a per-token divergence between the two next-token distributions over the sampled
completion (reverse KL by default), averaged over each completion then over the batch. The
teacher is an exponential moving average of the student (or the frozen base model).

The divergence and its top-k variant follow TRL's ``trl.experimental.sdft.loss_utils`` (TRL
1.16) term for term, so a batch gives TRL's loss; they are restated here because TRL is an
optional dependency and its experimental API may change.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import string
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from forgetless.contract.hooks import Batch, Stage, StepContext, TaskContext
from forgetless.contract.method import Capability, Knob, Method, MethodConfig, declare_method
from forgetless.contract.plan import TrainStats
from forgetless.core.fields import Count, Fraction, Positive
from forgetless.core.modules import trainable_parameters
from forgetless.core.storage import MethodState
from forgetless.errors import DataError, ModelLoadError
from forgetless.methods.papers import cite
from forgetless.tasks.base import Example
from forgetless.tasks.formatting import (
    IGNORE_INDEX,
    Features,
    collate,
    completion_window,
    encode_prompt,
)

_TRL = "TRL's SDFTConfig"


# --- the teacher's prompt ------------------------------------------------------------------


def teacher_example(example: Example, template: str) -> Example:
    """``example`` as the teacher sees it: its prompt (the last user turn of a chat) rewritten by
    ``template`` to hold its own demonstration, the completion."""
    text = template.format(prompt=example.prompt, demonstration=example.completion)
    if example.messages is None:
        return dataclasses.replace(example, prompt=text)
    *head, user, answer = example.messages
    if user.get("role") != "user":
        raise DataError(
            f"sdft puts the demonstration into the last user turn, but the prompt ends with a "
            f"{user.get('role')!r} turn"
        )
    content = template.format(prompt=user["content"], demonstration=example.completion)
    return dataclasses.replace(
        example, prompt=text, messages=(*head, {**user, "content": content}, answer)
    )


def prompt_length(labels: list[int]) -> int:
    """Tokens before the first labelled one: the prompt of a completion-only feature."""
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def completion_feature(prompt: list[int], completion: list[int]) -> Features:
    """Prompt + completion ids, the prompt masked out of the labels."""
    return {"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion}


# --- sampling ------------------------------------------------------------------------------


def up_to_eos(ids: list[int], eos_id: int | None) -> list[int]:
    """``ids`` up to and including the first EOS (what follows it is padding)."""
    return ids[: ids.index(eos_id) + 1] if eos_id in ids else ids


@torch.no_grad()
def sample_completions(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    pad_id: int,
    eos_id: int | None,
) -> list[list[int]]:
    """One completion of each prompt sampled at ``temperature`` from the full distribution (no
    top-k or top-p), in eval mode, batched with left padding; each ends at its first EOS."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    was_training = model.training
    model.eval()
    out = model.generate(  # type: ignore[operator]
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
    )
    model.train(was_training)
    return [up_to_eos(row, eos_id) for row in out[:, width:].tolist()]


# --- the loss ------------------------------------------------------------------------------


def completion_logits(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits that predict each row's labelled tokens, packed from the left: ``(B, C, V)``
    and the ``(B, C)`` mask of real positions. ``labels`` are right-padded and aligned with the
    trailing ``logits.shape[1]`` positions (as a ``logits_to_keep`` forward leaves them)."""
    labels = labels[:, -logits.shape[1] :]
    labelled = labels[:, 1:] != IGNORE_INDEX
    counts = labelled.sum(dim=1)
    offsets = torch.arange(max(int(counts.max()), 1), device=logits.device)
    first = labelled.float().argmax(dim=1)
    positions = (first[:, None] + offsets[None]).clamp(max=logits.shape[1] - 2)
    index = positions[..., None].expand(-1, -1, logits.shape[-1])
    return logits[:, :-1].gather(1, index), offsets[None] < counts[:, None]


def kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) over the last axis, from log-probabilities."""
    return (logp.exp() * (logp - logq)).sum(-1)


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per position: KL(p_T ‖ p_S) at ``alpha`` 0, KL(p_S ‖ p_T) at 1, and in between
    α·KL(p_T ‖ m) + (1−α)·KL(p_S ‖ m) with m = (1−α)·p_S + α·p_T (TRL's ``compute_divergence``).
    Inputs are log-probabilities over the same support."""
    if alpha == 0.0:
        return kl(teacher, student)
    if alpha == 1.0:
        return kl(student, teacher)
    weighted = torch.stack([student + math.log(1 - alpha), teacher + math.log(alpha)])
    mix = torch.logsumexp(weighted, dim=0)
    return alpha * kl(teacher, mix) + (1 - alpha) * kl(student, mix)


def with_tail(logp: torch.Tensor) -> torch.Tensor:
    """Top-k log-probabilities plus one bucket holding the mass left out of them."""
    held = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logp, torch.log(-torch.expm1(held))], dim=-1)


def top_k_support(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, k: int, tail: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions on the student's top-k tokens: renormalised there, or with a tail
    bucket for the rest of the mass (TRL's ``topk_logits`` mode)."""
    top, index = torch.topk(student_logits, k=k, dim=-1)
    student = top - torch.logsumexp(student_logits, dim=-1, keepdim=True)
    teacher = teacher_logits.gather(-1, index) - torch.logsumexp(
        teacher_logits, dim=-1, keepdim=True
    )
    if tail:
        return with_tail(student), with_tail(teacher)
    return (
        student - torch.logsumexp(student, dim=-1, keepdim=True),
        teacher - torch.logsumexp(teacher, dim=-1, keepdim=True),
    )


def sdft_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    alpha: float = 1.0,
    top_k: int | None = None,
    tail: bool = False,
) -> torch.Tensor:
    """SDFT's loss on aligned completion logits ``(B, C, V)``: the per-token divergence
    (:func:`generalized_jsd`, on the full vocabulary or the student's top-k) averaged over each
    row's ``mask`` positions, then over the rows; 0, still attached, when nothing is masked in."""
    if not bool(mask.any()):
        return student_logits.sum() * 0.0
    if top_k is None:
        student = torch.log_softmax(student_logits, dim=-1)
        teacher = torch.log_softmax(teacher_logits, dim=-1)
    else:
        student, teacher = top_k_support(student_logits, teacher_logits, top_k, tail)
    per_token = generalized_jsd(student, teacher, alpha) * mask
    return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean()


@torch.no_grad()
def ema_update(pairs: list[tuple[torch.Tensor, torch.Tensor]], rate: float) -> None:
    """teacher ← (1 − rate)·teacher + rate·student for each (teacher, student) tensor pair, in
    place (TRL's ``SyncRefModelCallback`` rule, the same two operations)."""
    for teacher, student in pairs:
        teacher.mul_(1.0 - rate).add_(student.detach(), alpha=rate)


# --- the method ----------------------------------------------------------------------------


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


class SDFTConfig(MethodConfig):
    name: Literal["sdft"] = "sdft"
    """SDFT: on-policy self-distillation from demonstrations."""
    teacher: Literal["ema", "base"] = Field(
        "ema",
        description="ema: an exponential moving average of the student, started from it at each "
        "task's start (the paper). base: the frozen model the run starts from, the same for "
        f"every task ({_TRL} teacher_model_kind='base'; its 'live' is ema with ema_rate 1).",
    )
    ema_rate: Fraction = Field(
        0.01,
        description="τ, the EMA teacher's step: teacher ← (1−τ)·teacher + τ·student after every "
        f"optimizer step. 0.01 in the paper's code; {_TRL} default is 0.05.",
    )
    alpha: Fraction = Field(
        1.0,
        description="The divergence: 1 is the reverse KL(p_student ‖ p_teacher) of the paper, 0 "
        "the forward KL(p_teacher ‖ p_student), in between the generalised Jensen-Shannon "
        f"divergence ({_TRL} distillation_alpha, default 0.5 there).",
    )
    top_k: Count | None = Field(
        None,
        description="null: the divergence over the full vocabulary (the paper). k: over the "
        f"student's top-k tokens only ({_TRL} distillation_mode='topk_logits', k=100 there).",
    )
    top_k_tail: bool = False
    """With top_k: add one bucket for the probability mass outside the top-k instead of
    renormalising the top-k (TRL's distillation_add_tail)."""
    skip_tokens: int = Field(0, ge=0)
    """Leave the first N completion tokens out of the loss (TRL's num_loss_tokens_to_skip; the
    paper's training script uses 3)."""
    max_new_tokens: Count | None = None
    """Length limit of a sampled completion (default: the task's)."""
    temperature: Positive = 1.0
    """Sampling temperature; both models' logits are divided by it in the loss, as TRL does (1.0 in
    the paper and TRL)."""
    template: str = Field(
        "{prompt}\n\n{demonstration}",
        description="The teacher's prompt (or last user turn) from the example's {prompt} and "
        f"its {{demonstration}}, the gold completion ({_TRL} teacher_prompt_template).",
    )

    @model_validator(mode="after")
    def _coherent(self) -> SDFTConfig:
        if _fields(self.template) != {"prompt", "demonstration"}:
            raise ValueError(
                "method.template must use exactly the fields {prompt} and {demonstration}"
            )
        if self.top_k_tail and self.top_k is None:
            raise ValueError("method.top_k_tail needs method.top_k")
        return self


def padding_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)


def frozen(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


@declare_method(
    SDFTConfig,
    capabilities={Capability.TRAIN_STAGE, Capability.BATCH_TRANSFORM, Capability.STATE},
    paper=cite("shenfeld2026"),
)
class SDFT(Method[SDFTConfig]):
    """Self-Distillation Fine-Tuning ("Self-Distillation Enables Continual Learning", Shenfeld et
    al. 2026, arXiv:2601.19897). Each task trains through the shared loop on its examples, each
    batch replaced by the student's own sampled completions of the prompts (``transform_batch``);
    the loss is :func:`sdft_loss` between the student on prompt + sample and the teacher on the
    prompt holding the demonstration (``template``) + the same sample. The EMA teacher is a copy
    of the student taken at the task's start and moved toward it at the first micro-batch after
    each optimizer step (the update TRL makes at the step's end, before the teacher's next use);
    its trainable tensors are the method's state while the task trains, so a step checkpoint
    resumes it. Costs per micro-batch: one generation, one student and one teacher forward; the
    EMA teacher is one more copy of the model (a LoRA student included)."""

    knob = Knob("lr_scale", keeps_more="lower", low=0.01, high=1.0, learning_rate=True)
    unsharded = "samples with the whole model and keeps a whole teacher beside FSDP2's shards"
    unquantized = "keeps an EMA teacher, a second whole copy of the model"
    unzeroed = "keeps an EMA teacher of the weights, not yet checked under DeepSpeed's engine"
    smoke: ClassVar[dict[str, Any]] = {"max_new_tokens": 4, "ema_rate": 0.5}

    def __init__(self, config: SDFTConfig) -> None:
        super().__init__(config)
        self.teacher: nn.Module | None = None
        self._base: nn.Module | None = None
        self._pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._prompts: list[list[int]] = []
        self._rows: list[Features] = []
        self._step: int | None = None
        self._sampled = [0, 0]  # completions, tokens

    def train_task(self, stage: Stage) -> TrainStats:
        ctx = stage.ctx
        self.begin_task(ctx)
        features = [{**f, "index": [i]} for i, f in enumerate(ctx.train_features)]
        try:
            stats = stage.sft(features=features, loss_fn=self.loss, label="sdft")
        finally:
            self.teacher, self._pairs, self._rows = None, {}, []
        completions, tokens = self._sampled
        details = {
            "teacher": self.config.teacher,
            "sampled_completions": completions,
            "mean_sampled_tokens": round(tokens / max(completions, 1), 3),
        }
        return dataclasses.replace(stats, details={**stats.details, **details})

    def begin_task(self, ctx: TaskContext) -> None:
        """The teacher's prompt of every training example (by its index in the task) and the
        teacher itself: a copy of the student now, or the base."""
        examples = ctx.task.train[: len(ctx.train_features)]
        self._prompts = [self._teacher_prompt(ctx, i, e) for i, e in enumerate(examples)]
        self.teacher, self._step, self._sampled = self._start_teacher(ctx), None, [0, 0]

    def _teacher_prompt(self, ctx: TaskContext, index: int, example: Example) -> list[int]:
        try:
            return encode_prompt(ctx.tokenizer, teacher_example(example, self.config.template))
        except DataError as err:
            raise DataError(f"task {ctx.task.name!r} example {index}: {err}") from None

    def _start_teacher(self, ctx: TaskContext) -> nn.Module:
        if self.config.teacher == "base":
            if self._base is None:
                if ctx.run.load_base is None:
                    raise ModelLoadError("sdft's base teacher needs RunInfo.load_base")
                self._base = frozen(ctx.run.load_base()).to(ctx.device)
            return self._base
        teacher = frozen(copy.deepcopy(ctx.model))
        mirror = dict(teacher.named_parameters())
        self._pairs = {n: (mirror[n], p) for n, p in trainable_parameters(ctx.model).items()}
        self._restore()
        return teacher

    def transform_batch(self, features: list[Features], ctx: StepContext) -> list[Features]:
        """The student's sampled completions of the batch's prompts (``index``: the row's place
        in the batch); the teacher's rows, the same samples after its prompts, are kept for the
        loss."""
        self._sync_teacher(ctx)
        task, cfg = ctx.task, self.config
        tokenizer = task.tokenizer
        prompts = [f["input_ids"][: prompt_length(f["labels"])] for f in features]
        samples = sample_completions(
            task.model,
            prompts,
            cfg.max_new_tokens or task.task.max_new_tokens,
            cfg.temperature,
            padding_id(tokenizer),
            tokenizer.eos_token_id,
        )
        self._sampled[0] += len(samples)
        self._sampled[1] += sum(len(s) for s in samples)
        teacher_prompts = [self._prompts[f["index"][0]] for f in features]
        self._rows = [
            completion_feature(p, s) for p, s in zip(teacher_prompts, samples, strict=True)
        ]
        return [
            {**completion_feature(p, s), "index": [j]}
            for j, (p, s) in enumerate(zip(prompts, samples, strict=True))
        ]

    def _sync_teacher(self, ctx: StepContext) -> None:
        """Move the EMA teacher once per optimizer step, before the step's first sample."""
        if ctx.step == self._step:
            return
        if ctx.step > 0 and self._pairs:
            ema_update(list(self._pairs.values()), self.config.ema_rate)
        self._step = ctx.step

    def loss(self, batch: Batch, outputs: Any, ctx: StepContext) -> torch.Tensor:
        """:func:`sdft_loss` of the student's ``outputs`` on ``batch`` against the teacher on the
        rows ``transform_batch`` kept for it."""
        assert self.teacher is not None, "train_task starts the teacher"
        cfg, device = self.config, batch["input_ids"].device
        rows = [self._rows[j] for j in batch["index"].tolist()]
        taught = {k: v.to(device) for k, v in collate(rows, padding_id(ctx.task.tokenizer)).items()}
        with (
            torch.no_grad(),
            torch.autocast(device.type, torch.bfloat16, enabled=ctx.autocast),
        ):
            teacher_logits = self.teacher(
                input_ids=taught["input_ids"],
                attention_mask=taught["attention_mask"],
                logits_to_keep=completion_window(taught["labels"]),
                use_cache=False,
            ).logits
        student, mask = completion_logits(outputs.logits.float(), batch["labels"])
        teacher, _ = completion_logits(teacher_logits.float(), taught["labels"])
        mask = mask & (torch.arange(mask.shape[1], device=device) >= cfg.skip_tokens)
        t = cfg.temperature
        return sdft_loss(student / t, teacher / t, mask, cfg.alpha, cfg.top_k, cfg.top_k_tail)

    def state_dict(self) -> MethodState:
        """While a task trains: the sampling counts and the EMA teacher's trainable tensors
        (nothing between tasks: the next task starts its teacher from the student)."""
        if self.teacher is None:
            return {}
        teacher = {n: t.detach().cpu() for n, (t, _) in self._pairs.items()}
        return {"sampled": list(self._sampled), **({"teacher": teacher} if teacher else {})}

    def load_state_dict(self, state: MethodState) -> None:
        self._sampled = list(state.get("sampled", self._sampled))
        self._pending = dict(state.get("teacher", {}))
        self._restore()

    def _restore(self) -> None:
        if not self._pending or not self._pairs:
            return
        missing = sorted(set(self._pairs) - set(self._pending))
        if missing:
            raise ValueError(f"sdft state lacks the teacher tensor {missing[0]!r}")
        with torch.no_grad():
            for name, (teacher, _) in self._pairs.items():
                teacher.copy_(self._pending[name])
        self._pending = {}
