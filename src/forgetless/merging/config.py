"""Each merge rule's parameters, defined once and shared by ``forgetless merge`` and the continual
merge methods (one config per rule, one default), and the ``forgetless merge`` YAML schema.

```yaml
base_model: path/to/base            # a local HF model folder
tasks:                              # full model folders or PEFT adapter folders, in order
  - path: runs/a/merged-task-1
    weight: 1.0
  - path: adapters/task-2
method: {name: ties, density: 0.2, scaling: 1.0}
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from forgetless.errors import ConfigError
from forgetless.strict import StrictModel


class Strict(StrictModel):
    """A merge config section (unknown keys, non-finite numbers, booleans for numbers refused)."""


class GCWMParams(BaseModel):
    """GCWM's knobs (docs/merging.md); the merge config and the continual method share them."""

    rank: int = Field(
        64,
        ge=1,
        description="Truncated-SVD rank kept per task update of a dense (full fine-tuning) "
        "matrix; LoRA updates are used exactly. Toolkit default (the paper gives none).",
    )
    metric: Literal["barycenter", "mean"] = Field(
        "barycenter",
        description="Shared metric: the Gaussian Wasserstein barycenter of the task geometries "
        "(the paper), or their arithmetic mean (the paper's ablation).",
    )
    conflict_cancellation: bool = Field(
        True,
        description="Let the layer's conflict govern the correction branch (the paper). False is "
        "the paper's 'no conflict cancellation' ablation, read here as a constant gate = strength.",
    )
    gate_direction: Literal["hold_back", "amplify"] = Field(
        "hold_back",
        description="hold_back (the paper's text): high conflict holds back the geometry-aware "
        "correction, g = β(1 − h(κ)); amplify (a public implementation): g = β·h(κ).",
    )
    gate_shape: Literal["linear", "sigmoid", "step"] = Field(
        "linear",
        description="h(κ): κ itself, σ((κ − threshold)/temperature), or 1[κ > threshold].",
    )
    threshold: float = Field(0.5, ge=0, le=1, description="κ threshold of the sigmoid/step gate.")
    temperature: float = Field(0.1, gt=0, description="Temperature of the sigmoid gate.")
    strength: float = Field(
        1.0, ge=0, le=1, description="β, the largest weight of the correction branch."
    )
    conflict_trace_normalized: bool = Field(
        False, description="Compute the conflict on C / tr C (removes the update-size effect)."
    )
    metric_floor: float = Field(
        1.0,
        ge=0,
        description="ρ: the metric's eigenvalues on the shared span are floored at ρ·tr S / K "
        "before whitening (a barycenter of low-rank geometries is itself low rank). Toolkit.",
    )
    consensus_ridge: float = Field(
        1e-2,
        ge=0,
        description="ε: ridge ε·tr(ΣP)/K on the consensus system (near-parallel task subspaces "
        "make it ill-conditioned). Toolkit default.",
    )
    max_iter: int = Field(50, ge=1, description="Barycenter fixed-point iterations at most.")
    tol: float = Field(1e-6, gt=0, description="Barycenter stop: relative Frobenius change.")


class TaskArithmeticParams(BaseModel):
    """Task arithmetic (Ilharco et al. 2023): ``θ = θ₀ + λ Σ_t w_t τ_t``."""

    scaling: float = Field(
        1.0,
        ge=0,
        description="λ on the weighted sum of task vectors (the paper's and mergekit's 1). Run "
        "continually, 1 is sequential fine-tuning; the benchmarks pin 0.5.",
    )


class TiesParams(BaseModel):
    """TIES-merging (Yadav et al. 2023): trim, elect a sign, merge the agreeing entries."""

    density: float = Field(
        0.2, gt=0, le=1, description="k, the share of entries kept per tensor (paper: top-20%)."
    )
    scaling: float = Field(
        1.0, ge=0, description="λ on the merged task vector (paper: 1 without validation data)."
    )
    convention: Literal["paper", "mergekit"] = Field(
        "paper",
        description="paper: keep ⌈k·n⌉ entries of each weighted task vector, elect sgn(Σ) (0 where "
        "the sum is 0), average the agreeing entries by count. mergekit (its ties method, 0.1.5): "
        "keep ⌊k·n⌋ entries of each unweighted vector, weight them, elect + where the sum is ≥ 0, "
        "and merge the agreeing ones as set by normalize.",
    )
    normalize: bool = Field(
        True,
        description="With convention mergekit: divide the agreeing weighted sum by the agreeing "
        "weights (mergekit's normalize, default true); false keeps the sum.",
    )


class DareParams(BaseModel):
    """DARE (Yu et al. 2024): drop entries at random, rescale the rest, then task arithmetic."""

    drop_rate: float = Field(0.9, ge=0, lt=1, description="p, the share of entries dropped.")
    scaling: float = Field(1.0, ge=0, description="λ on the weighted sum of the rescaled vectors.")
    seed: int = Field(
        0, ge=0, lt=2**32, description="Seed of the drop masks (per tensor and task)."
    )


class OPCMParams(BaseModel):
    """OPCM (Tang et al. 2025): project each update off the merged update's leading subspace."""

    alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        description="α: the leading singular directions of the merged update holding this share "
        "of its nuclear norm are protected (the authors' scripts use 0.5).",
    )


class TaskArithmeticMerge(Strict, TaskArithmeticParams):
    name: Literal["task_arithmetic"] = Field(description="θ = θ₀ + λ Σ w_t τ_t (Ilharco 2023).")


class TiesMerge(Strict, TiesParams):
    name: Literal["ties"] = Field(description="TIES-merging (Yadav et al. 2023).")


class DareMerge(Strict, DareParams):
    name: Literal["dare"] = Field(description="DARE then task arithmetic (Yu et al. 2024).")


class OPCMMerge(Strict, OPCMParams):
    name: Literal["opcm"] = Field(description="Orthogonal projection continual merging.")


class GCWMMerge(Strict, GCWMParams):
    name: Literal["gcwm"] = Field(description="Geometry-conflict Wasserstein merging.")


MergeMethod = Annotated[
    TaskArithmeticMerge | TiesMerge | DareMerge | OPCMMerge | GCWMMerge,
    Field(discriminator="name"),
]


class MergeTask(Strict):
    path: Path = Field(description="A full model folder (safetensors) or a PEFT adapter folder.")
    weight: float = Field(1.0, description="w_t, this task's weight (OPCM ignores it).")


class MergeConfig(Strict):
    base_model: Path = Field(description="Local HF model folder the tasks were trained from.")
    tasks: list[MergeTask] = Field(min_length=1, description="Task checkpoints, in order.")
    method: MergeMethod = Field(description="Merge method and its parameters.")
    dtype: Literal["base", "float32", "bfloat16", "float16"] = Field(
        "base", description="Output dtype; base keeps each tensor's dtype."
    )


def load_merge_config(path: Path) -> MergeConfig:
    """YAML → :class:`MergeConfig`; any problem is one ConfigError line naming the field."""
    from pydantic import ValidationError

    from forgetless.config.loading import format_validation_error, read_yaml

    try:
        return MergeConfig.model_validate(read_yaml(path))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, str(path))) from None
