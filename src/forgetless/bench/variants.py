"""Bench variants: a method plus overrides under a name of its own (``kl_sft@beta=0.5``)."""

from __future__ import annotations

import random
from typing import Any

from forgetless.config.bench import BenchSection, ClusterSection, Variant
from forgetless.errors import ConfigError

__all__ = [
    "BUILTIN_VARIANTS",
    "BenchSection",
    "ClusterSection",
    "Variant",
    "parse_variant",
    "select_variants",
]

BUILTIN_VARIANTS = (
    Variant(
        name="replay-general",
        method={"name": "replay", "general": {"source": "prose", "ratio": 0.25}},
    ),
)
"""Baselines that are a method with options, named like a method (``--methods replay-general``);
a config's variant of the same name wins."""


def parse_variant(spec: str) -> Variant:
    """``method`` or ``method@key=value,key.path=value``: bare keys are method fields."""
    name, _, rest = spec.strip().partition("@")
    if not name:
        raise ConfigError(f"variant {spec!r}: missing method name")
    method: dict[str, Any] = {"name": name}
    extra: list[str] = []
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"variant {spec!r}: {item!r} must look like key=value")
        extra.append(f"{key}={value}" if "." in key else f"method.{key}={value}")
    return Variant(name=spec.strip(), method=method, set=extra)


def select_variants(specs: list[str], named: list[Variant]) -> list[Variant]:
    """The variants ``specs`` ask for: a config variant by its name, a built-in one by its name,
    else a method spec."""
    by_name = {v.name: v for v in [*BUILTIN_VARIANTS, *named]}
    return [by_name.get(spec.strip()) or parse_variant(spec) for spec in specs]


def task_order(n_tasks: int, seed: int, order: int) -> list[int]:
    """Order 0 keeps the config's order; order k > 0 is a permutation drawn under (seed, k)."""
    indices = list(range(n_tasks))
    if order > 0:
        random.Random(f"forgetless-order/{seed}/{order}").shuffle(indices)
    return indices


def run_folder_name(seed: int, order: int, orders: int) -> str:
    return f"s{seed}" if orders == 1 else f"s{seed}-o{order}"
