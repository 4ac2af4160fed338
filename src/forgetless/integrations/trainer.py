"""A forgetting-control method inside an existing ``transformers.Trainer`` or TRL trainer script.

    EWCTrainer = with_method(SFTTrainer, "ewc", lam=1e4, probes=["copy"])
    trainer = EWCTrainer(model=model, args=args, train_dataset=task1, processing_class=tok)
    trainer.train()
    trainer.next_task(task2)         # EWC's Fisher and anchor; a fresh optimizer
    trainer.train()

``with_method`` returns a subclass of the trainer class with ``ForgettingControlMixin`` first,
which overrides ``compute_loss`` (the one place a loss term can enter a trainer), ``train`` (the
task's start) and ``log`` (the method's figures ride on the trainer's own log, so every
``report_to`` integration carries them). The class holds one ``ForgettingControl``: every
trainer built from it continues the same task sequence, so a script that builds a new trainer
per task keeps the method's state too. ``class MyTrainer(ForgettingControlMixin, SFTTrainer)``
with ``forgetting = ForgettingControl(...)`` is the same thing written out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import Trainer

from forgetless.contract.method import Method, MethodConfig
from forgetless.integrations.control import ForgettingControl

if TYPE_CHECKING:
    _Base = Trainer
else:
    _Base = object


def _plain_compute_loss(cls: type) -> bool:
    """Whether the ``compute_loss`` after the mixin in ``cls``'s order is ``Trainer``'s own."""
    order = cls.__mro__
    after = order[order.index(ForgettingControlMixin) + 1 :]
    owner = next(c for c in after if "compute_loss" in vars(c))
    return owner is Trainer


class ForgettingControlMixin(_Base):
    """Put first in a trainer's bases; ``forgetting`` (a class attribute, or the keyword of the
    same name) is the ``ForgettingControl`` it runs."""

    forgetting: ForgettingControl

    def __init__(self, *args: Any, forgetting: ForgettingControl | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        control = forgetting or getattr(type(self), "forgetting", None)
        if control is None:
            raise TypeError(
                f"{type(self).__name__}: give forgetting=ForgettingControl(...) or build the "
                "class with forgetless.integrations.with_method"
            )
        self.forgetting = control
        control.attach(self, reuse_outputs=_plain_compute_loss(type(self)))

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        control = self.forgetting
        step_loss = control.step_loss
        if not model.training or step_loss is None or control.ctx is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss, outputs = step_loss(
            self, super().compute_loss, model, inputs, control.step_context(), num_items_in_batch
        )
        return (loss, outputs) if return_outputs else loss

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self.forgetting.start_task()
        output = super().train(*args, **kwargs)
        self.forgetting.train_finished()
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        control = getattr(self, "forgetting", None)  # None while the trainer is being built
        if control is not None:
            control.merge_logs(logs)
        super().log(logs, start_time)

    def next_task(self, train_dataset: Any, name: str | None = None) -> None:
        """End the task (the method's task-boundary work), then take ``train_dataset`` (prepared
        as the trainer prepares its own) as the next task's data, with a fresh optimizer."""
        control = self.forgetting
        control.end_task()
        control.next_name = name
        self.train_dataset = _prepared(self, train_dataset)
        if control.owns_optimizer:
            self.optimizer = None  # type: ignore[assignment]

    def end_task(self) -> None:
        """End the task without starting another (its state saved, say)."""
        self.forgetting.end_task()


def _prepared(trainer: Any, dataset: Any) -> Any:
    """``dataset`` as TRL's trainers prepare a training set (tokenized, labelled, truncated);
    as it is for a trainer that prepares nothing."""
    prepare = getattr(trainer, "_prepare_dataset", None)
    if prepare is None or getattr(trainer, "_skip_prepare_dataset", False):
        return dataset
    args = trainer.args
    formatting = getattr(trainer, "_formatting_func", None)
    return prepare(dataset, trainer.processing_class, args, args.packing, formatting, "train")


def with_method(
    trainer_cls: type[Trainer],
    method: str | MethodConfig | Method[Any] | ForgettingControl,
    /,
    **options: Any,
) -> type[ForgettingControlMixin]:
    """``trainer_cls`` with a forgetting-control method: ``method`` a registered name (its
    config fields and ``ForgettingControl``'s keywords in ``options``), a config, a method or
    a control. A method that cannot run inside a trainer raises its one line here."""
    if isinstance(method, ForgettingControl):
        if options:
            raise TypeError("with_method: give options to the ForgettingControl, not beside it")
        control = method
    else:
        control = ForgettingControl(method, **options)
    name = f"{type(control.method).__name__}{trainer_cls.__name__}"
    attrs = {"forgetting": control, "__module__": trainer_cls.__module__}
    return type(name, (ForgettingControlMixin, trainer_cls), attrs)
