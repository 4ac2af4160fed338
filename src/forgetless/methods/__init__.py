"""Forgetting-control methods. Importing this package registers every method module in it."""

import importlib
import pkgutil

from forgetless.methods.base import (
    Capability,
    Method,
    MethodConfig,
    create_method,
    method_class,
    register_method,
    registered_methods,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base" and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "Capability",
    "Method",
    "MethodConfig",
    "create_method",
    "method_class",
    "register_method",
    "registered_methods",
]
