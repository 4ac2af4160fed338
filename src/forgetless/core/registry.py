"""The method registry: a name to a method class, and the rules read from a method's declaration.

A method is declared once (``forgetless.contract.declare_method``), which adds it here. This
floor imports nothing by name: a name it does not hold yet it asks the *finder* for, which the
methods floor installs (``forgetless.methods``): it imports the built-in module that declares the
name, or loads an outside package's entry point. Classes are held as ``Any``: this floor knows
their declared attributes, not the contract's types.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

METHODS = "forgetless.methods"
"""The entry-point group an outside package declares its methods in."""
_METHODS: dict[str, Any] = {}


@dataclass(frozen=True)
class Finder:
    """Where names not registered yet are found, by entry-point group (``METHODS``, or another
    registry's, such as the merge methods')."""

    names: Callable[[str], list[str]]
    """Every name declared in a group, nothing imported."""
    load: Callable[[str, str], None]
    """Import what declares a name of a group (nothing when no one declares it)."""


_FINDER: list[Finder] = []


def install_finder(finder: Finder) -> None:
    """Set the finder (``forgetless.methods`` does, on import; the last one installed wins)."""
    _FINDER[:] = [finder]


def declared_names(group: str) -> list[str]:
    """The names declared in ``group``, registered or not, without importing any."""
    return [n for finder in _FINDER for n in finder.names(group)]


def load_declared(group: str, name: str) -> None:
    """Import what declares ``name`` in ``group``, when something does."""
    for finder in _FINDER:
        finder.load(group, name)


def add(name: str, cls: Any) -> None:
    if name in _METHODS:
        raise ValueError(f"method {name!r} is already registered")
    _METHODS[name] = cls


def lookup(name: str) -> Any | None:
    """The class registered as ``name`` (loading its declaration if needed), or None."""
    if name not in _METHODS and name.isidentifier():
        load_declared(METHODS, name)
    return _METHODS.get(name)


def known_names() -> list[str]:
    """Every method name, registered or only declared, sorted (for error messages: cheap)."""
    return sorted(set(_METHODS) | set(declared_names(METHODS)))


def did_you_mean(name: str, known: list[str]) -> str:
    """``"; did you mean 'sae_fd'?"`` for the closest of ``known`` names (a typo, ``-`` for
    ``_``), or "" when none is close."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(name.replace("-", "_").lower(), known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_method(name: str) -> str:
    """The one line for a method name nothing registers or declares."""
    known = known_names()
    return f"unknown method {name!r}; known: {', '.join(known)}{did_you_mean(name, known)}"


def all_methods() -> dict[str, Any]:
    """Every method, each declared one loaded (for listings)."""
    for name in declared_names(METHODS):
        lookup(name)
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
    full_only = getattr(method, "full_only", None)
    if full_only and mode == "lora":
        return f"method {method.name!r} {full_only}: it needs finetune.mode full"
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


_PACKING_CONFLICTS = (
    ("activation_hooks", "reads activations through hooks, which would span the packed row"),
    ("replace_loss", "replaces the task loss, which reads the logits row by row"),
    ("loss_terms", "adds loss terms that read the logits row by row"),
    ("train_stage", "trains in a stage of its own, whose losses may read the rows"),
)


def padding_rule_broken(method: Any) -> str | None:
    """What stops ``method`` from training on padding-free batches (``train.padding_free``:
    a micro-batch's examples packed into one row), or None.

    ``padding_free_ok`` says it outright; unset, the method can when only the default loss
    sees the packed row: no activation hook, no own stage, and no loss that reads the logits
    (``window_ok`` says its loss terms never do)."""
    declared = getattr(method, "padding_free_ok", None)
    if declared is True:
        return None
    capabilities = {getattr(c, "value", c) for c in getattr(method, "capabilities", ())}
    if getattr(method, "window_ok", False):
        capabilities.discard("loss_terms")
    why = next((w for c, w in _PACKING_CONFLICTS if c in capabilities), None)
    if declared is False and why is None:
        why = "reads its batches row by row"
    if why is None:
        return None
    name = getattr(method, "name", "?")
    return (
        f"method {name!r} does not train on padding-free batches: it {why}; "
        "set train.padding_free false"
    )


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
