"""Forgetting-control methods. Importing this package registers every built-in method."""

from forgetless.methods import seq_ft
from forgetless.methods.base import (
    Capability,
    Method,
    MethodConfig,
    create_method,
    method_class,
    register_method,
    registered_methods,
)

__all__ = [
    "Capability",
    "Method",
    "MethodConfig",
    "create_method",
    "method_class",
    "register_method",
    "registered_methods",
    "seq_ft",
]
