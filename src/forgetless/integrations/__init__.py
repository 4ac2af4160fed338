"""forgetless inside a ``transformers.Trainer`` or TRL trainer script (docs/integrations.md).

    from forgetless.integrations import with_method
    EWCTrainer = with_method(SFTTrainer, "ewc", lam=1e4, probes=["copy"])
    trainer = EWCTrainer(model=model, args=args, train_dataset=task1, processing_class=tok)
    trainer.train()
    trainer.next_task(task2)
    trainer.train()

The method's loss terms, batch transforms, gradient hooks, update gates and task-boundary work
run inside the trainer through the same hooks as a forgetless run; retention and the KL to the
base go out through the trainer's own ``log``; a forgetting budget is held from a callback. A
method that trains a task in its own stage refuses in one line (``refusal``) and points to
``forgetless.ContinualTrainer``.
"""

from forgetless.integrations.callback import ForgettingCallback
from forgetless.integrations.control import ForgettingControl, TrainerRefusal
from forgetless.integrations.fit import refusal, trainer_support
from forgetless.integrations.trainer import ForgettingControlMixin, with_method

__all__ = [
    "ForgettingCallback",
    "ForgettingControl",
    "ForgettingControlMixin",
    "TrainerRefusal",
    "refusal",
    "trainer_support",
    "with_method",
]
