"""The contract between the engine and the methods: capabilities, hook contexts, the stage, the
plan and stats of a task's training, and the declaration that registers a method."""

from forgetless.contract.method import (
    Capability,
    Method,
    MethodConfig,
    Paper,
    RunInfo,
    Stage,
    StepContext,
    TaskContext,
    TaskEndContext,
    create_method,
    declare_method,
    method_class,
    register_method,
    registered_methods,
)
from forgetless.contract.plan import TrainPlan, TrainStats

__all__ = [
    "Capability",
    "Method",
    "MethodConfig",
    "Paper",
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
]
