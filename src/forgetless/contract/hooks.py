"""What the hooks are handed and hand back: the run, the task, the step, the end of a task and
the stage, the batch and a replacement loss, and how a state tensor is reduced across processes.
A method imports these beside its declaration (``contract.method``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from forgetless.contract.plan import TrainPlan, TrainStats
from forgetless.core.storage import MethodState as MethodState  # what state_dict hands back
from forgetless.errors import ModelLoadError

if TYPE_CHECKING:
    from forgetless.eval.generation import EvalResult
    from forgetless.tasks.base import Task
    from forgetless.tasks.formatting import Features


Batch = dict[str, torch.Tensor]
LossFn = Callable[[Batch, Any, "StepContext"], torch.Tensor]
ReduceOp = Literal["sum", "mean", "max"]
"""How a state tensor (``Method.reduce_ops``) is reduced across processes before it is saved."""


@dataclass
class RunInfo:
    """What a method may know about the whole run."""

    seed: int
    out_dir: Path
    task_names: list[str]
    probe_names: list[str]
    finetune_mode: str
    max_length: int = 64
    lora_regime: str | None = None
    load_base: Callable[[], nn.Module] | None = None
    """Loads a fresh copy of the base model (before any task): for frozen references."""

    def base_loader(self, method: str) -> Callable[[], nn.Module]:
        """``load_base``, or a ModelLoadError naming ``method`` when the runner gave none."""
        if self.load_base is None:
            raise ModelLoadError(
                f"{method} needs the runner's base-model loader (RunInfo.load_base)"
            )
        return self.load_base


@dataclass
class TaskContext:
    """The task being trained, with its tokenized training data (1-based ``task_index``).

    ``sequence`` is the whole task sequence (joint training needs the tasks still to come).
    """

    run: RunInfo
    task_index: int
    task: Task
    model: nn.Module
    tokenizer: Any
    train_features: list[Features]
    past_tasks: list[Task]
    device: torch.device
    sequence: list[Task] = field(default_factory=list)


@dataclass
class StepContext:
    """One optimizer step of the shared loop."""

    task: TaskContext
    step: int
    total_steps: int
    global_batch_size: int = 0
    """Examples in the step's micro-batch over all processes (after any batch transform)."""
    batch_share: float = 1.0
    """This process's share of the micro-batch's labelled tokens (1.0 with one process): a
    token-mean value ``v`` of this process is worth ``batch_share * v`` of the global one."""
    autocast: bool = False
    """The step's forward pass runs under bfloat16 autocast (``TrainPlan.autocast``)."""


@dataclass
class TaskEndContext:
    """End-of-task view: the task context plus every evaluation just made on the trained model."""

    task: TaskContext
    eval_results: dict[str, EvalResult]
    stats: TrainStats


@dataclass
class Stage:
    """Handed to a ``TRAIN_STAGE`` method: it trains the task itself, through the shared loop.

    ``sft`` runs the runner's step loop (with the method's other hooks) on ``features`` (default:
    the task's data) with an optional loss that replaces cross-entropy; a stage may call it many
    times (outer/inner loops) or hand the model to another trainer.
    """

    ctx: TaskContext
    sft: Callable[..., TrainStats]
    out_dir: Path
    plan: TrainPlan
