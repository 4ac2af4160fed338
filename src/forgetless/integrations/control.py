"""A forgetting-control method carried through a sequence of tasks trained by a
``transformers.Trainer`` (or any subclass: TRL's ``SFTTrainer``...).

The control holds what a forgetless run's ``TaskSession`` holds: the method, the task's context,
its hooks, the budget's monitor. A trainer reaches it at four points (``forgetless.integrations
.trainer``): ``train()`` starts the task (``on_task_start``, activation hooks),
``compute_loss`` adds the method's terms, a callback gates updates and holds the budget, and
``next_task`` (or a new trainer on the same control) ends the task (``on_task_end``: Fisher,
anchors, replay memory), so the method's state carries to the next one.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn
from transformers import AutoModelForCausalLM

from forgetless.config.budget import BudgetConfig
from forgetless.config.loading import format_validation_error
from forgetless.contract.method import (
    Capability,
    Method,
    MethodConfig,
    MethodState,
    RunInfo,
    StepContext,
    TaskContext,
    TaskEndContext,
    create_method,
)
from forgetless.contract.plan import TrainStats
from forgetless.core import registry
from forgetless.engine.budget import BudgetMonitor
from forgetless.errors import ConfigError
from forgetless.integrations.batches import features_of
from forgetless.integrations.callback import ForgettingCallback
from forgetless.integrations.fit import refusal
from forgetless.integrations.measure import ProbeMeter, resolve_probes
from forgetless.integrations.step import StepLoss
from forgetless.models.loading import lost_text_warning
from forgetless.tasks.base import Example, Task
from forgetless.training.budget_probe import budget_measure

PREFIX = "forgetless/"
"""Every figure the control adds to the trainer's logs starts with it."""


class TrainerRefusal(ConfigError):
    """A method that cannot run inside a trainer's step; the message is its one line."""


def build_method(
    method: str | MethodConfig | Method[Any], options: Mapping[str, Any]
) -> Method[Any]:
    """A method instance from its name (with config ``options``), its config, or itself."""
    if isinstance(method, Method):
        if options:
            raise ConfigError("give options in the method's config, not beside an instance")
        built = method
    elif isinstance(method, MethodConfig):
        built = create_method(method.model_copy(update=dict(options)))
    else:
        built = _named_method(method, options)
    line = refusal(type(built))
    if line is not None:
        raise TrainerRefusal(line)
    return built


def _named_method(name: str, options: Mapping[str, Any]) -> Method[Any]:
    """The registered method ``name`` with its config's ``options``; a one-line ConfigError
    for an unknown name or a bad option (as a config file gets)."""
    cls = registry.lookup(name)
    if cls is None:
        raise ConfigError(registry.unknown_method(name))
    try:
        config = cls.config_cls.model_validate({"name": name, **options})
    except ValidationError as err:
        raise ConfigError(
            format_validation_error(err, f"method {name!r}", cls.config_cls)
        ) from None
    built: Method[Any] = cls(config)
    return built


def sharded_by(trainer: Any) -> str | None:
    """The engine that splits ``trainer``'s weights or optimizer over processes, or None."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed"
    return None


def tokenizer_of(trainer: Any) -> Any:
    """The trainer's tokenizer (a processor's own tokenizer)."""
    processing = trainer.processing_class
    if processing is None:
        raise ConfigError("forgetless.integrations needs the trainer's processing_class=tokenizer")
    return getattr(processing, "tokenizer", processing)


def training_batches(trainer: Any) -> Any:
    """The trainer's training data through its collator, in dataset order: a sequential pass
    that draws nothing from the random state the training order comes from."""
    build = getattr(trainer, "_get_dataloader", None)  # no sampler, no cached loader
    if build is None:
        return trainer.get_eval_dataloader(trainer.train_dataset)
    return build(trainer.train_dataset, "forgetless", trainer.args.per_device_eval_batch_size)


def placeholder_task(name: str) -> Task:
    """A task named ``name`` whose data the trainer holds (methods read only its name here)."""
    return Task(name, train=[], eval=[Example(prompt="", completion="")], description=name)


class ForgettingControl:
    """Runs ``method`` inside a trainer over a sequence of tasks (module docstring).

    ``method``: a registered name (with its config fields as ``options``), a config or a method
    instance. ``probes`` (``Task`` objects or built-in names) give the retention and KL to the
    base that the trainer logs, and the probe batch a ``budget`` is held on. ``base`` is how a
    method that needs the base model (KL-SFT's reference, SAE-FD's SAE) gets a fresh copy: a
    loader, a source for ``from_pretrained``, or None: the model's own ``name_or_path``, else a
    CPU copy taken when the control first meets it.
    """

    def __init__(
        self,
        method: str | MethodConfig | Method[Any],
        /,
        *,
        probes: Sequence[Task | str] = (),
        budget: BudgetConfig | Mapping[str, Any] | None = None,
        probe_batch: int = 64,
        max_length: int = 128,
        base: Callable[[], nn.Module] | str | None = None,
        **options: Any,
    ) -> None:
        self.method = build_method(method, options)
        self.budget = BudgetConfig.model_validate(budget) if isinstance(budget, Mapping) else budget
        if self.budget is not None and self.method.knob is None:
            raise ConfigError(f"method {self.method.name!r} has no knob for a budget to steer")
        if self.budget is not None and not probes:
            raise ConfigError("a budget is held on probes: give probes=[...]")
        self.probes, self.probe_size, self.max_length = list(probes), probe_batch, max_length
        self.base: Callable[[], nn.Module] | str | None = base
        self.trainer: Any = None
        self.ctx: TaskContext | None = None
        self.names: list[str] = []
        self.next_name: str | None = None
        self.meter: ProbeMeter | None = None
        self.monitor: BudgetMonitor | None = None
        self.step_loss: StepLoss | None = None
        self.history: list[dict[str, Any]] = []
        """One record per ended task: its name, steps, last measure, budget trace, details."""
        self.measured: dict[str, float] = {}
        self.pending: dict[str, float] = {}
        """Figures waiting for the trainer's next ``log``."""
        self.owns_optimizer = True
        """The trainer builds its optimizer (none was handed to it): a task gets a fresh one."""
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._trained = False
        self._budget_task = 0

    # --- a trainer meets the control ---

    def attach(self, trainer: Any, reuse_outputs: bool = False) -> None:
        """Bind ``trainer``; a task trained by the trainer bound before ends first."""
        if trainer is self.trainer:
            return
        sharding = sharded_by(trainer)
        if sharding:
            raise TrainerRefusal(
                f"forgetless.integrations runs in one process or under DDP, not under {sharding}: "
                "a method reads and writes whole weights between steps; use `forgetless run` "
                "under accelerate launch (FSDP2, ZeRO-1/2) instead"
            )
        if self.trainer is not None:
            self.end_task()
        else:
            self._first_meeting(trainer)
        self.trainer = trainer
        pad_id = tokenizer_of(trainer).pad_token_id
        pad_id = pad_id if pad_id is not None else tokenizer_of(trainer).eos_token_id
        self.step_loss = StepLoss(self.method, pad_id, reuse_outputs)
        self.owns_optimizer = trainer.optimizer is None
        trainer.add_callback(ForgettingCallback(self))

    def _first_meeting(self, trainer: Any) -> None:
        """The model as the control first meets it is the base: the loader of its copies, the
        meter's reference and the budget's."""
        model, tokenizer = trainer.model, tokenizer_of(trainer)
        lost = lost_text_warning(tokenizer)
        if lost:
            warnings.warn(lost, UserWarning, stacklevel=2)
        if self.base is None:
            self.base = self._default_base(model)
        if not self.probes:
            return
        examples = max(self.probe_size, self.budget.probe_batch if self.budget else 0)
        probes = resolve_probes(self.probes, examples, trainer.args.seed)
        self.meter = ProbeMeter(probes, tokenizer, self.max_length, self.probe_size)
        self.meter.fix_base(model)
        if self.budget is not None:
            measure = budget_measure(self.budget, model, tokenizer, probes, self.max_length)
            self.monitor = BudgetMonitor(self.budget, self.method, measure)

    def _default_base(self, model: nn.Module) -> Callable[[], nn.Module] | str:
        source = getattr(getattr(model, "config", None), "name_or_path", "")
        if source:
            return str(source)
        snapshot = copy.deepcopy(model).cpu()
        return lambda: copy.deepcopy(snapshot)

    def load_base(self) -> nn.Module:
        """A fresh copy of the base model (``RunInfo.load_base``)."""
        if callable(self.base):
            return self.base()
        if self.base is None:
            raise ConfigError("the base model is unknown before a trainer is attached")
        dtype = next(self.trainer.model.parameters()).dtype
        return AutoModelForCausalLM.from_pretrained(self.base, dtype=dtype)

    # --- the task's life cycle ---

    def start_task(self) -> None:
        """Start the next task (on the first ``train()`` of it): its context and hooks."""
        if self.ctx is not None:
            return
        trainer, method = self.trainer, self.method
        name = self.next_name or f"task-{len(self.names) + 1}"
        self.names.append(name)
        self.next_name = None
        ctx = TaskContext(
            run=self._run_info(trainer),
            task_index=len(self.names),
            task=placeholder_task(name),
            model=trainer.model,
            tokenizer=tokenizer_of(trainer),
            train_features=[],
            past_tasks=[placeholder_task(n) for n in self.names[:-1]],
            device=trainer.args.device,
            sequence=[placeholder_task(n) for n in self.names],
        )
        if method.uses(Capability.TASK_START) or method.uses(Capability.ACTIVATION_HOOKS):
            ctx.train_features = features_of(training_batches(trainer))
        self.ctx = ctx
        if method.uses(Capability.TASK_START):
            method.on_task_start(ctx)
        if method.uses(Capability.ACTIVATION_HOOKS):
            self._handles = method.register_hooks(ctx)

    def _run_info(self, trainer: Any) -> RunInfo:
        lora = getattr(trainer.model, "peft_config", None) is not None
        return RunInfo(
            seed=trainer.args.seed,
            out_dir=Path(trainer.args.output_dir),
            task_names=list(self.names),
            probe_names=[p if isinstance(p, str) else p.name for p in self.probes],
            finetune_mode="lora" if lora else "full",
            max_length=self.max_length,
            lora_regime="carry" if lora else None,
            load_base=self.load_base,
        )

    def train_finished(self) -> None:
        """After a ``train()`` call: measure, and log the measure through the trainer."""
        self._trained = True
        if self.meter is None:
            return
        self.measured = self.meter.measure(self.trainer.model)
        self.trainer.log({PREFIX + k: v for k, v in self.measured.items()})

    def end_task(self) -> None:
        """The task's end: hooks removed, then the method's task-boundary work."""
        ctx, trainer = self.ctx, self.trainer
        if ctx is None:
            return
        for handle in self._handles:
            handle.remove()
        self._handles, self.ctx = [], None
        steps = trainer.state.global_step if self._trained else 0
        stats = TrainStats(steps=steps)
        if self.method.uses(Capability.TASK_END):
            if not ctx.train_features:
                ctx.train_features = features_of(training_batches(trainer))
            was_training = ctx.model.training
            self.method.on_task_end(TaskEndContext(ctx, {}, stats))
            ctx.model.train(was_training)
        record: dict[str, Any] = {"task": ctx.task.name, "steps": steps, **self.measured}
        if self.monitor is not None and self._budget_task == ctx.task_index:
            record["budget"] = self.monitor.summary()
        if stats.details:
            record["details"] = stats.details
        self.history.append(record)
        self._trained, self.measured = False, {}

    # --- per step (called by the trainer and its callback) ---

    def step_context(self) -> StepContext:
        assert self.ctx is not None, "start_task builds the context"
        state = self.trainer.state
        return StepContext(
            task=self.ctx,
            step=state.global_step,
            total_steps=state.max_steps,
            autocast=bool(self.trainer.args.bf16),
        )

    def loop_started(self, model: nn.Module, optimizer: Any, scheduler: Any, steps: int) -> None:
        if self.monitor is None or self.ctx is None:
            return
        if self._budget_task != self.ctx.task_index:
            self._budget_task = self.ctx.task_index
            self.monitor.begin_task(steps)
        self.monitor.loop_started(model, optimizer, scheduler)

    def budget_checked(self, before: int) -> None:
        """Queue the budget's latest check for the log, if one was made since ``before``."""
        assert self.monitor is not None
        if len(self.monitor.trace) == before:
            return
        entry = self.monitor.trace[-1]
        self.pending.update(
            {
                PREFIX + "budget_loss": entry["loss"],
                PREFIX + self.monitor.knob.field: entry["next"],
                PREFIX + "rolled_back": entry.get("rolled_back", 0.0),
            }
        )

    def merge_logs(self, logs: dict[str, float]) -> None:
        """Add the terms' means since the last log and the queued figures to ``logs``."""
        if self.step_loss is not None:
            logs.update({PREFIX + k: v for k, v in self.step_loss.take_means().items()})
        logs.update(self.pending)
        self.pending = {}

    # --- state ---

    def state_dict(self) -> MethodState:
        """The method's state, the tasks seen and the budget's knob: enough to go on later."""
        state: MethodState = {"method": self.method.state_dict(), "names": list(self.names)}
        if self.monitor is not None:
            state["knob"] = self.monitor.value
        return state

    def load_state_dict(self, state: MethodState) -> None:
        self.method.load_state_dict(state.get("method", {}))
        self.names = list(state.get("names", []))
        if self.monitor is not None and "knob" in state:
            self.monitor.value = float(state["knob"])
            self.method.set_knob(self.monitor.value)
