"""The method registry: a name to a method class, the built-ins loaded on first use.

``forgetless.contract.register_method`` adds a class. A built-in method lives in
``forgetless.methods.<name>`` (or, while experimental, ``forgetless.experimental.methods.<name>``)
and is imported only when its name is first looked up, so that validating a config imports the
one method it names, not every method's dependencies. Classes
are held as ``Any``: this floor knows their declared attributes, not the contract's types.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from pathlib import Path
from typing import Any

BUILTIN_PACKAGES = ("forgetless.methods", "forgetless.experimental.methods")
_METHODS: dict[str, Any] = {}


def add(name: str, cls: Any) -> None:
    if name in _METHODS:
        raise ValueError(f"method {name!r} is already registered")
    _METHODS[name] = cls


def _module_names(package: str) -> list[str]:
    """The modules of ``package``, found on disk without importing it (importing the
    experimental corner warns, and a lookup of a stable method must not)."""
    top, *rest = package.split(".")
    spec = importlib.util.find_spec(top)
    roots = list(spec.submodule_search_locations or []) if spec else []
    paths = [str(Path(root, *rest)) for root in roots]
    return [m.name for m in pkgutil.iter_modules(paths) if not m.name.startswith("_")]


def _builtin_modules() -> list[str]:
    """``package.module`` of every built-in method module, stable first."""
    return [f"{p}.{m}" for p in BUILTIN_PACKAGES for m in _module_names(p)]


def lookup(name: str) -> Any | None:
    """The class registered as ``name`` (importing its built-in module if needed), or None."""
    if name not in _METHODS and name.isidentifier():
        module = next((m for m in _builtin_modules() if m.rsplit(".", 1)[1] == name), None)
        if module is not None:
            importlib.import_module(module)
    return _METHODS.get(name)


def all_methods() -> dict[str, Any]:
    """Every registered method, the built-ins imported (for listings and error messages)."""
    for module in _builtin_modules():
        importlib.import_module(module)
    return dict(_METHODS)


def lora_rule_broken(method: Any, mode: str, regime: str) -> str | None:
    """What a fine-tuning mode and LoRA regime break of ``method``'s declared rules, or None.

    The one place the rules are read (``lora_regimes``: the method needs LoRA in one of these
    regimes; ``carry_only``: why it needs one adapter for the whole sequence under LoRA). The
    config schema calls it at validate, the runner for a method instance handed over directly.
    """
    regimes = getattr(method, "lora_regimes", None)
    if regimes is not None and (mode != "lora" or regime not in regimes):
        return f"method {method.name!r} needs finetune.mode lora with regime {' or '.join(regimes)}"
    carry_only = getattr(method, "carry_only", None)
    if carry_only and mode == "lora" and regime != "carry":
        return (
            f"method {method.name!r} {carry_only}: with LoRA it needs regime carry, not {regime!r}"
        )
    return None


def sharding_rule_broken(
    method: Any, mode: str, config: Any = None, regime: str = "carry"
) -> str | None:
    """What stops ``method`` (configured by ``config``, when given; LoRA in ``regime``) from
    running on a sharded model (an FSDP2 launch), or None."""
    name = getattr(method, "name", "?")
    unsharded = getattr(method, "unsharded", None)
    if config is not None and hasattr(method, "unsharded_with"):
        unsharded = method.unsharded_with(config)
    if unsharded:
        return f"method {name!r} does not run sharded (FSDP2): it {unsharded}"
    if mode == "lora" and regime == "merge":
        return (
            "finetune.lora.regime merge does not run sharded (FSDP2): each task's adapter is "
            "merged into the split weights; use regime carry or per_task (adapters attached "
            "before the split), mode full, or a data-parallel launch"
        )
    return None


def zero_rule_broken(method: Any, budget: bool, checkpoint_every: int | None) -> str | None:
    """What stops ``method`` (under a forgetting budget or with step checkpoints, when set)
    from training through DeepSpeed's ZeRO-1/2 engine, or None."""
    why = getattr(method, "unzeroed", None)
    if why:
        return (
            f"method {getattr(method, 'name', '?')!r} does not run under DeepSpeed ZeRO: it {why}"
        )
    split = "which the engine splits over the processes; use a data-parallel or FSDP2 launch"
    if budget:
        return (
            "budget does not run under DeepSpeed ZeRO: a rollback restores the optimizer's "
            f"state, {split}"
        )
    if checkpoint_every is not None:
        return (
            "train.checkpoint_every does not run under DeepSpeed ZeRO: a step checkpoint saves "
            f"the optimizer's state, {split} (the checkpoint after each task needs none)"
        )
    return None
