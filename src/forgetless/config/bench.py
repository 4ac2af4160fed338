"""The ``bench:`` section of a config file: the variants a bench compares, its seeds and orders,
and the cluster jobs it may send its runs to. A run ignores it; ``forgetless bench`` reads it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from forgetless.core.fields import Count, Positive


class Variant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="Name shown in tables and used as the output folder.")
    method: dict[str, Any] = Field(description="The method config (its name and fields).")
    set: list[str] = Field(default_factory=list, description="Extra overrides, key.path=value.")


class ClusterSection(BaseModel):
    """Where ``bench --cluster slurm`` sends each run: one Slurm job per run, through submitit."""

    model_config = ConfigDict(extra="forbid")
    partition: str | None = Field(None, description="Slurm partition (None: the default one).")
    timeout_min: Count = Field(240, description="Wall-time limit of each run's job (min).")
    cpus_per_task: Count = Field(2, description="CPU cores per run (its torch threads).")
    gpus_per_task: int = Field(0, ge=0, description="GPUs per run.")
    mem_gb: Positive | None = Field(None, description="Memory per run (None: the default).")
    poll_seconds: Positive = Field(30.0, description="How often the bench checks its jobs.")


class BenchSection(BaseModel):
    """The optional ``bench:`` section of a config file."""

    model_config = ConfigDict(extra="forbid")
    variants: list[Variant] = Field(default_factory=list, description="Named variants to compare.")
    seeds: Count = Field(3, description="Seeds per variant.")
    first_seed: int = Field(
        0, ge=0, lt=2**32, description="First seed (tune on seeds apart from measuring ones)."
    )
    orders: Count = Field(1, description="Task orders per seed (order 0 is the config's).")
    cluster: ClusterSection = Field(
        default_factory=ClusterSection, description="Job settings for bench --cluster."
    )
