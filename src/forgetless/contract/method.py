"""The method interface: capabilities, the declaration and the registry.

A forgetting-control method is one class in one file, declared once (``@declare_method``: its
name, config class, capabilities and paper). It overrides exactly the hooks its capabilities
name; the runner calls nothing else. Registration checks that declaration and overrides agree,
so a hook cannot be silently ignored. What the hooks are handed is in ``contract.hooks``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

import torch
from torch import nn

from forgetless.contract.hooks import (
    Batch,
    ReduceOp,
    Stage,
    StepContext,
    TaskContext,
    TaskEndContext,
)
from forgetless.contract.hooks import RunInfo as RunInfo  # importable here, as it used to be
from forgetless.contract.plan import TrainStats
from forgetless.core import registry
from forgetless.core.modules import trainable_parameters as trainable_parameters  # as it was
from forgetless.core.storage import MethodState
from forgetless.strict import MethodConfig

if TYPE_CHECKING:
    from forgetless.tasks.formatting import Features


class Capability(str, Enum):
    """What a method hooks into. Each capability names exactly one hook (see ``HOOKS``)."""

    MODEL_SETUP = "model_setup"
    TASK_START = "task_start"
    BATCH_TRANSFORM = "batch_transform"
    ACTIVATION_HOOKS = "activation_hooks"
    REPLACE_LOSS = "replace_loss"
    LOSS_TERMS = "loss_terms"
    UPDATE_GATE = "update_gate"
    TRAIN_STAGE = "train_stage"
    MODEL_TRANSFORM = "model_transform"
    TASK_END = "task_end"
    STATE = "state"


HOOKS: dict[Capability, tuple[str, ...]] = {
    Capability.MODEL_SETUP: ("setup_model",),
    Capability.TASK_START: ("on_task_start",),
    Capability.BATCH_TRANSFORM: ("transform_batch",),
    Capability.ACTIVATION_HOOKS: ("register_hooks",),
    Capability.REPLACE_LOSS: ("task_loss",),
    Capability.LOSS_TERMS: ("loss_terms",),
    Capability.UPDATE_GATE: ("gate_update",),
    Capability.TRAIN_STAGE: ("train_task",),
    Capability.MODEL_TRANSFORM: ("transform_model",),
    Capability.TASK_END: ("on_task_end",),
    Capability.STATE: ("state_dict", "load_state_dict"),
}


@dataclass(frozen=True)
class Knob:
    """The strength a forgetting budget steers (``forgetless.engine.budget``).

    ``field`` names a config field the method reads while it trains (EWC's ``lam``, KL-SFT's
    ``beta``); with ``learning_rate`` the knob is a factor on the loop's learning rate instead,
    recorded under ``field``. ``keeps_more`` says which way holds more of the base; the
    controller keeps the value in ``[low, high]``.
    """

    field: str
    keeps_more: Literal["higher", "lower"]
    low: float
    high: float
    learning_rate: bool = False


@dataclass(frozen=True)
class Paper:
    """The paper a method implements, as data (``forgetless methods`` and the docs cite it)."""

    title: str
    authors: str = ""
    """Short form: ``Kirkpatrick et al.``."""
    year: int | None = None
    venue: str = ""
    """Where it appeared: a venue, an arXiv id or both."""

    def __str__(self) -> str:
        who = " ".join(p for p in (self.authors, str(self.year or "")) if p)
        return ", ".join(p for p in (who, f'"{self.title}"', self.venue) if p)


ConfigT = TypeVar("ConfigT", bound=MethodConfig)


class Method(Generic[ConfigT]):
    """Base of all methods, typed by its config (``class EWC(Method[EWCConfig])``). Hooks raise
    unless overridden; the runner calls only declared ones."""

    name: ClassVar[str]
    config_cls: ClassVar[type[MethodConfig]]
    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    paper: ClassVar[Paper | None] = None
    """The paper the method implements; None for a plain baseline."""
    reduce_ops: ClassVar[Mapping[str, ReduceOp]] = {}
    """How state tensors (by key prefix) are reduced across processes before they are saved."""
    lora_regimes: ClassVar[tuple[str, ...] | None] = None
    """When set, the method needs ``finetune.mode: lora`` with one of these regimes."""
    smoke: ClassVar[dict[str, Any]] = {}
    """Config fields for a seconds-long run on the tiny model: the conformance matrix and the
    benchmark harness take them from here (the LoRA regime from ``lora_regimes``)."""
    window_ok: ClassVar[bool] = False
    """True when the method's loss terms never read ``outputs.logits``' values, so the loop may
    compute logits only over the completion window (methods without ``LOSS_TERMS`` or
    ``REPLACE_LOSS`` get the window anyway, since they never see the outputs)."""
    tail_logits_ok: ClassVar[bool] = False
    """True when the method's loss hooks read ``outputs.logits`` only over the positions they
    are given, aligning labels by the tail (``labels[:, -logits.size(1):]``), and compute any
    reference over the same: the loop may then give them the completion window's logits alone
    (``logits_to_keep``), which spares most of a large vocabulary's output layer."""
    padding_free_ok: ClassVar[bool | None] = None
    """Whether the method trains correctly on padding-free batches (``train.padding_free``);
    None: decided from its capabilities by :func:`padding_rule_broken`, at validate."""
    unsharded: ClassVar[str | None] = (
        "keeps state or touches weights in ways not yet made to work on FSDP2's sharded parameters"
    )
    """Why the method cannot run on a sharded model (FSDP2), or None when it can. Checked by
    :func:`sharding_rule_broken`, at ``validate --fsdp`` and when a sharded run starts."""

    unzeroed: ClassVar[str | None] = None
    """Why the method cannot train through DeepSpeed's ZeRO-1/2 engine, or None when it can
    (every process holds whole weights there). Checked by :func:`zero_rule_broken`."""

    @classmethod
    def unsharded_with(cls, config: MethodConfig) -> str | None:
        """Why the method, configured so, cannot run sharded: ``unsharded`` unless an option of
        the method changes the answer."""
        return cls.unsharded

    knob: ClassVar[Knob | None] = None
    """The strength a forgetting budget steers, or None (the method cannot run under one)."""
    carry_only: ClassVar[str | None] = None
    """When set, why the method needs one adapter for the whole sequence under LoRA (regime
    ``carry``): it keeps per-weight state by name. Checked with ``lora_regimes`` by
    :func:`lora_rule_broken`, at validate."""
    full_only: ClassVar[str | None] = None
    unquantized: ClassVar[str | None] = None
    """When set, why the method cannot run on a 4-bit base (``model.quantization``: it needs the
    base's full weights or a second full copy); checked by ``quantized_rule_broken``."""
    """When set, why the method refuses LoRA (it needs ``finetune.mode full``); checked too."""

    def __init__(self, config: ConfigT) -> None:
        self.config: ConfigT = config

    def uses(self, capability: Capability) -> bool:
        return capability in self.capabilities

    def knob_value(self) -> float:
        """The knob's value the method starts from (1.0 for a learning-rate factor)."""
        knob = self.knob
        if knob is None:
            raise TypeError(f"method {self.name!r} has no knob")
        return 1.0 if knob.learning_rate else float(getattr(self.config, knob.field))

    def set_knob(self, value: float) -> None:
        """Set a config knob (a learning-rate knob is applied by the loop, not here)."""
        knob = self.knob
        if knob is not None and not knob.learning_rate:
            setattr(self.config, knob.field, value)

    def on_task_start(self, ctx: TaskContext) -> None:
        raise NotImplementedError

    def transform_batch(self, features: list[Features], ctx: StepContext) -> list[Features]:
        raise NotImplementedError

    def register_hooks(self, ctx: TaskContext) -> list[torch.utils.hooks.RemovableHandle]:
        raise NotImplementedError

    def task_loss(self, batch: Batch, outputs: Any, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError

    def loss_terms(self, batch: Batch, outputs: Any, ctx: StepContext) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def gate_update(
        self, model: nn.Module, pre_step: dict[str, torch.Tensor], ctx: StepContext
    ) -> None:
        raise NotImplementedError

    def train_task(self, stage: Stage) -> TrainStats:
        raise NotImplementedError

    def transform_model(self, model: nn.Module, ctx: TaskContext) -> nn.Module:
        raise NotImplementedError

    def setup_model(self, model: nn.Module) -> None:
        raise NotImplementedError

    def on_task_end(self, ctx: TaskEndContext) -> None:
        raise NotImplementedError

    def state_dict(self) -> MethodState:
        """Tensors and JSON-able values to restore after a resume."""
        return {}

    def load_state_dict(self, state: MethodState) -> None:
        if state:
            raise ValueError(f"method {self.name!r} keeps no state but got keys {sorted(state)}")


def _overridden(cls: type[Method], hook: str) -> bool:
    return getattr(cls, hook) is not getattr(Method, hook)


def check_method_class(cls: type[Method]) -> None:
    """Raise TypeError when the declared capabilities and the overridden hooks disagree."""
    for capability, hooks in HOOKS.items():
        for hook in hooks:
            declared, overridden = capability in cls.capabilities, _overridden(cls, hook)
            if declared and not overridden and capability is not Capability.STATE:
                raise TypeError(f"{cls.__name__} declares {capability.value} but lacks {hook}()")
            if overridden and not declared:
                raise TypeError(
                    f"{cls.__name__} overrides {hook}() without declaring {capability.value}"
                )


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: add a method whose class sets ``name``, ``config_cls`` and
    ``capabilities`` itself to the registry (``declare_method`` says them in one place)."""
    name = cls.name
    if not name.isidentifier() or name != name.lower():
        raise ValueError(f"method name {name!r} must be a lowercase identifier")
    field_info = cls.config_cls.model_fields["name"]
    if getattr(field_info.annotation, "__args__", None) != (name,):
        raise TypeError(f"{cls.config_cls.__name__}.name must be Literal[{name!r}]")
    check_method_class(cls)
    registry.add(name, cls)
    return cls


MethodT = TypeVar("MethodT", bound=type[Method])


def declare_method(
    config: type[MethodConfig],
    capabilities: Iterable[Capability] = (),
    paper: Paper | None = None,
) -> Callable[[MethodT], MethodT]:
    """Class decorator: a method's one declaration (its config class, which names it through
    ``name: Literal["x"]``, its capabilities and its paper), checked and registered.

    The class overrides the hooks of exactly ``capabilities``. A module outside the package
    that declares a method is found through the entry-point group ``forgetless.methods``
    (docs/architecture.md).
    """
    name = _declared_name(config)

    def declare(cls: MethodT) -> MethodT:
        cls.name, cls.config_cls, cls.paper = name, config, paper
        cls.capabilities = frozenset(capabilities)
        register_method(cls)
        return cls

    return declare


def _declared_name(config: type[MethodConfig]) -> str:
    names: tuple[Any, ...] = getattr(config.model_fields["name"].annotation, "__args__", ())
    if len(names) != 1 or not isinstance(names[0], str):
        raise TypeError(f"{config.__name__}.name must be Literal['<method name>']")
    found: str = names[0]
    return found


def registered_methods() -> dict[str, type[Method]]:
    """All registered methods by name, the built-ins included."""
    return registry.all_methods()


def method_class(name: str) -> type[Method]:
    cls = registry.lookup(name)
    if cls is None:
        raise KeyError(registry.unknown_method(name))
    found: type[Method] = cls
    return found


def create_method(config: MethodConfig) -> Method:
    return method_class(config.name)(config)
