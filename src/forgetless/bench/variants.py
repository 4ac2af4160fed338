"""Bench variants: a method plus overrides under a name of its own (``kl_sft@beta=0.5``)."""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forgetless.errors import ConfigError


class Variant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="Name shown in tables and used as the output folder.")
    method: dict[str, Any] = Field(description="The method config (its name and fields).")
    set: list[str] = Field(default_factory=list, description="Extra overrides, key.path=value.")


class ClusterSection(BaseModel):
    """Where ``bench --cluster slurm`` sends each run: one Slurm job per run, through submitit."""

    model_config = ConfigDict(extra="forbid")
    partition: str | None = Field(None, description="Slurm partition (None: the default one).")
    timeout_min: int = Field(240, ge=1, description="Wall-time limit of each run's job (min).")
    cpus_per_task: int = Field(2, ge=1, description="CPU cores per run (its torch threads).")
    gpus_per_task: int = Field(0, ge=0, description="GPUs per run.")
    mem_gb: float | None = Field(None, gt=0, description="Memory per run (None: the default).")
    poll_seconds: float = Field(30.0, gt=0, description="How often the bench checks its jobs.")


class BenchSection(BaseModel):
    """The optional ``bench:`` section of a config file."""

    model_config = ConfigDict(extra="forbid")
    variants: list[Variant] = Field(default_factory=list, description="Named variants to compare.")
    seeds: int = Field(3, ge=1, description="Seeds per variant.")
    first_seed: int = Field(
        0, ge=0, lt=2**32, description="First seed (tune on seeds apart from measuring ones)."
    )
    orders: int = Field(1, ge=1, description="Task orders per seed (order 0 is the config's).")
    cluster: ClusterSection = Field(
        default_factory=ClusterSection, description="Job settings for bench --cluster."
    )


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
    """The variants ``specs`` ask for: a config variant by its name, else a method spec."""
    by_name = {v.name: v for v in named}
    return [by_name.get(spec.strip()) or parse_variant(spec) for spec in specs]


def task_order(n_tasks: int, seed: int, order: int) -> list[int]:
    """Order 0 keeps the config's order; order k > 0 is a permutation drawn under (seed, k)."""
    indices = list(range(n_tasks))
    if order > 0:
        random.Random(f"forgetless-order/{seed}/{order}").shuffle(indices)
    return indices


def run_folder_name(seed: int, order: int, orders: int) -> str:
    return f"s{seed}" if orders == 1 else f"s{seed}-o{order}"


def pop_bench_section(data: dict[str, Any], source: str) -> BenchSection:
    """Remove and validate a config's ``bench:`` section (errors name the field, on one line)."""
    from forgetless.config.loading import format_validation_error

    try:
        return BenchSection.model_validate(data.pop("bench", None) or {})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, f"{source}: bench")) from None
