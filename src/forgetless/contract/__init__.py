"""The contract between the engine and the methods, in one place for code outside the package:
the declaration that registers a method (``contract.method``), what its hooks are handed
(``contract.hooks``), and the plan and stats of a task's training (``contract.plan``). A
built-in method imports from those modules: its declaration on one line, its hooks' types on
the next."""

from forgetless.contract.hooks import (
    Batch,
    LossFn,
    MethodState,
    ReduceOp,
    RunInfo,
    Stage,
    StepContext,
    TaskContext,
    TaskEndContext,
)
from forgetless.contract.method import (
    Capability,
    Knob,
    Method,
    MethodConfig,
    Paper,
    create_method,
    declare_method,
    method_class,
    register_method,
    registered_methods,
)
from forgetless.contract.plan import TrainPlan, TrainStats
from forgetless.core.modules import trainable_parameters

__all__ = [
    "Batch",
    "Capability",
    "Knob",
    "LossFn",
    "Method",
    "MethodConfig",
    "MethodState",
    "Paper",
    "ReduceOp",
    "RunInfo",
    "Stage",
    "StepContext",
    "TaskContext",
    "TaskEndContext",
    "TrainPlan",
    "TrainStats",
    "create_method",
    "declare_method",
    "method_class",
    "register_method",
    "registered_methods",
    "trainable_parameters",
]
