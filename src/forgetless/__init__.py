"""forgetless: continual post-training of language models, forgetting measured and explained.

The public API, importable from here (each name is loaded on first use, so ``import forgetless``
stays cheap)::

    from forgetless import Runner, RunConfig, load_config, declare_method, Method, MethodConfig

It also installs the method finder (``forgetless.methods``): a config may name a built-in method
or one an installed package declares in the entry-point group ``forgetless.methods``.
"""

from __future__ import annotations

import importlib
from typing import Any

from forgetless import methods as _methods  # noqa: F401  (installs the registry's finder)

__version__ = "0.1.0"

_PUBLIC = {
    "Runner": "forgetless.training.runner",
    "Results": "forgetless.training.results",
    "Evaluator": "forgetless.eval.evaluator",
    "ContinualTrainer": "forgetless.training.continual",
    "RunConfig": "forgetless.config.schema",
    "load_config": "forgetless.config.loading",
    "validate_config": "forgetless.config.loading",
    "Method": "forgetless.contract",
    "MethodConfig": "forgetless.contract",
    "Capability": "forgetless.contract",
    "TaskContext": "forgetless.contract",
    "StepContext": "forgetless.contract",
    "TaskEndContext": "forgetless.contract",
    "Stage": "forgetless.contract",
    "TrainPlan": "forgetless.contract",
    "TrainStats": "forgetless.contract",
    "Paper": "forgetless.contract",
    "declare_method": "forgetless.contract",
    "register_method": "forgetless.contract",
    "registered_methods": "forgetless.contract",
    "create_method": "forgetless.contract",
    "ForgetlessError": "forgetless.errors",
    "ConfigError": "forgetless.errors",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'forgetless' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
