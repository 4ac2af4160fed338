"""The ``bench:`` section of a config file: the variants a bench compares, its seeds and orders,
and the cluster jobs it may send its runs to. A run ignores it; ``forgetless bench`` reads it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgetless.core.fields import Count, Positive


class Variant(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    name: str
    """Name shown in tables and used as the output folder."""
    method: dict[str, Any]
    """The method config (its name and fields)."""
    set: list[str] = Field(default_factory=list)
    """Extra overrides, key.path=value."""


class ClusterSection(BaseModel):
    """Where ``bench --cluster slurm`` sends each run: one Slurm job per run, through submitit."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    partition: str | None = None
    """Slurm partition (None: the default one)."""
    timeout_min: Count = 240
    """Wall-time limit of each run's job (min)."""
    cpus_per_task: Count = 2
    """CPU cores per run (its torch threads)."""
    gpus_per_task: int = Field(0, ge=0)
    """GPUs per run."""
    mem_gb: Positive | None = None
    """Memory per run (None: the default)."""
    poll_seconds: Positive = 30.0
    """How often the bench checks its jobs."""


class BenchSection(BaseModel):
    """The optional ``bench:`` section of a config file."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    variants: list[Variant] = Field(default_factory=list)
    """Named variants to compare."""
    seeds: Count = 3
    """Seeds per variant."""
    first_seed: int = Field(0, ge=0, lt=2**32)
    """First seed (tune on seeds apart from measuring ones)."""
    orders: Count = 1
    """Task orders per seed (order 0 is the config's)."""
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    """Job settings for bench --cluster."""
