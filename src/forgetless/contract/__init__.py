"""The contract between the engine and the methods: capabilities, hook contexts, the stage, the
plan and stats of a task's training, and registration."""

from forgetless.contract.method import (
    Capability,
    Method,
    MethodConfig,
    RunInfo,
    Stage,
    StepContext,
    TaskContext,
    TaskEndContext,
    create_method,
    method_class,
    register_method,
    registered_methods,
)
from forgetless.contract.plan import TrainPlan, TrainStats

__all__ = [
    "Capability",
    "Method",
    "MethodConfig",
    "RunInfo",
    "Stage",
    "StepContext",
    "TaskContext",
    "TaskEndContext",
    "TrainPlan",
    "TrainStats",
    "create_method",
    "method_class",
    "register_method",
    "registered_methods",
]
