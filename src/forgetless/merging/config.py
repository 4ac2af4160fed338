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

A mergekit YAML (it names ``merge_method``) is read too: ``mergekit_yaml`` translates it.

``method`` is resolved by name through ``MERGE_METHODS``: the built-in rules below, and any a
module registers with ``register_merge_method``. A module that declares itself in the entry-point
group ``forgetless.merge_methods`` (the experimental corner does) is imported when a config first
names its method, so this floor never imports it by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from forgetless.core import registry
from forgetless.core.fields import Fraction, NonNegative
from forgetless.strict import DocumentedModel, StrictModel

MERGE_METHODS_GROUP = "forgetless.merge_methods"
"""The entry-point group a package declares its merge methods in."""


class Strict(StrictModel):
    """A merge config section (unknown keys, non-finite numbers, booleans for numbers refused)."""


class TaskArithmeticParams(DocumentedModel):
    """Task arithmetic (Ilharco et al. 2023): ``θ = θ₀ + λ Σ_t w_t τ_t``."""

    scaling: NonNegative = 1.0
    """λ on the weighted sum of task vectors (the paper's and mergekit's 1). Run continually, 1 is
    sequential fine-tuning; the benchmarks pin 0.5."""


class TiesParams(DocumentedModel):
    """TIES-merging (Yadav et al. 2023): trim, elect a sign, merge the agreeing entries."""

    density: float = Field(0.2, gt=0, le=1)
    """k, the share of entries kept per tensor (paper: top-20%)."""
    scaling: NonNegative = 1.0
    """λ on the merged task vector (paper: 1 without validation data)."""
    convention: Literal["paper", "mergekit"] = "paper"
    """paper: keep ⌈k·n⌉ entries of each weighted task vector, elect sgn(Σ) (0 where the sum is 0),
    average the agreeing entries by count. mergekit (its ties method, 0.1.5): keep ⌊k·n⌋ entries
    of each unweighted vector, weight them, elect + where the sum is ≥ 0, and merge the agreeing
    ones as set by normalize."""
    normalize: bool = True
    """With convention mergekit: divide the agreeing weighted sum by the agreeing weights
    (mergekit's normalize, default true); false keeps the sum."""


class DareParams(DocumentedModel):
    """DARE (Yu et al. 2024): drop entries at random, rescale the rest, then task arithmetic."""

    drop_rate: float = Field(0.9, ge=0, lt=1)
    """p, the share of entries dropped."""
    scaling: NonNegative = 1.0
    """λ on the weighted sum of the rescaled vectors."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seed of the drop masks (per tensor and task)."""
    rescale: Literal["inverse", "l1", "none"] = "inverse"
    """How the kept entries are rescaled: inverse by 1/(1−p) (the paper's Eq. 3); l1 so each tensor
    keeps its L1 norm (mergekit's rescale: true); none (rescale: false)."""
    elect_sign: bool = False
    """After the drop, TIES's sign election in mergekit's convention and the sum of the agreeing
    entries (mergekit's dare_ties); false: their weighted sum (dare_linear)."""
    normalize: bool = False
    """Divide the merged sum by the sum of the (agreeing) weights (mergekit's normalize; its dare
    methods default to false)."""


class OPCMParams(DocumentedModel):
    """OPCM (Tang et al. 2025): project each update off the merged update's leading subspace."""

    alpha: Fraction = 0.5
    """α: the leading singular directions of the merged update holding this share of its nuclear
    norm are protected (the authors' scripts use 0.5)."""


class MergeMethodConfig(Strict):
    """Base of a merge method's parameters; each pins ``name`` to a ``Literal``."""

    name: str


MergeT = TypeVar("MergeT", bound=MergeMethodConfig)
MERGE_METHODS: dict[str, type[MergeMethodConfig]] = {}
"""Each merge method's config class by name (the per-tensor rules are ``streaming``'s)."""


def register_merge_method(cls: type[MergeT]) -> type[MergeT]:
    """Class decorator: let a merge config name ``cls``'s method. A rule merged tensor by tensor
    also registers its merge (``forgetless.merging.streaming.register_tensor_rule``)."""
    names: tuple[Any, ...] = getattr(cls.model_fields["name"].annotation, "__args__", ())
    if len(names) != 1 or not isinstance(names[0], str):
        raise TypeError(f"{cls.__name__}.name must be a Literal of one name")
    if MERGE_METHODS.get(names[0], cls) is not cls:
        raise ValueError(f"merge method {names[0]!r} is already registered")
    MERGE_METHODS[names[0]] = cls
    return cls


Density = Annotated[float, Field(gt=0, le=1)]
DropRate = Annotated[float, Field(ge=0, lt=1)]


@register_merge_method
class TaskArithmeticMerge(MergeMethodConfig, TaskArithmeticParams):
    name: Literal["task_arithmetic"]
    """θ = θ₀ + λ Σ w_t τ_t (Ilharco 2023)."""
    normalize: bool = False
    """Divide Σ w_t τ_t by Σ w_t before λ (mergekit's normalize)."""


@register_merge_method
class TiesMerge(MergeMethodConfig, TiesParams):
    name: Literal["ties"]
    """TIES-merging (Yadav et al. 2023)."""
    density: Density | list[Density] = Field(  # type: ignore[assignment]
        0.2, description="k, the share kept per tensor (paper: 0.2), or one per task in order."
    )


@register_merge_method
class DareMerge(MergeMethodConfig, DareParams):
    name: Literal["dare"]
    """DARE then task arithmetic (Yu et al. 2024)."""
    drop_rate: DropRate | list[DropRate] = Field(  # type: ignore[assignment]
        0.9, description="p, the share of entries dropped, or one per task in order."
    )


class LinearParams(DocumentedModel):
    """The linear merge (Wortsman et al. 2022, model soups): ``θ = Σ_t w_t θ_t / Σ_t w_t``."""

    normalize: bool = True
    """Divide by Σ w_t (a weighted mean, mergekit's default); false keeps the weighted sum of the
    models."""


@register_merge_method
class LinearMerge(MergeMethodConfig, LinearParams):
    name: Literal["linear"]
    """Weighted mean of the models (model soups)."""


@register_merge_method
class OPCMMerge(MergeMethodConfig, OPCMParams):
    name: Literal["opcm"]
    """Orthogonal projection continual merging."""


def merge_method_class(name: str) -> type[MergeMethodConfig] | None:
    """The config class of merge method ``name`` (importing its declaration if needed), or None."""
    if name not in MERGE_METHODS and name.isidentifier():
        registry.load_declared(MERGE_METHODS_GROUP, name)
    return MERGE_METHODS.get(name)


def merge_method(value: Any) -> MergeMethodConfig:
    """A ``method`` entry as its merge method's own config; errors located under its name."""
    if isinstance(value, MergeMethodConfig):
        return value
    name = value.get("name") if isinstance(value, dict) else None
    if not isinstance(name, str):
        raise ValueError("needs a name: {name: ..., its options}")
    cls = merge_method_class(name)
    if cls is None:
        known = sorted(set(MERGE_METHODS) | set(registry.declared_names(MERGE_METHODS_GROUP)))
        raise ValueError(f"unknown merge method {name!r}; known: {', '.join(known)}")
    try:
        return cls.model_validate(value)
    except ValidationError as err:
        raise _under(name, err) from None


def _under(name: str, err: ValidationError) -> ValidationError:
    """``err`` with each location under ``name`` (``method.ties.density``)."""
    details = [
        {"type": e["type"], "loc": (name, *e["loc"]), "input": e["input"]}
        | ({"ctx": e["ctx"]} if "ctx" in e else {})
        for e in err.errors(include_url=False)
    ]
    return ValidationError.from_exception_data(err.title, details)  # type: ignore[arg-type]


class MergeTask(Strict):
    path: Path
    """A full model folder (safetensors) or a PEFT adapter folder."""
    weight: float = 1.0
    """w_t, this task's weight (OPCM ignores it)."""


class MergeConfig(Strict):
    base_model: Path
    """Local HF model folder the tasks were trained from."""
    tasks: list[MergeTask] = Field(min_length=1)
    """Task checkpoints, in order."""
    method: SerializeAsAny[MergeMethodConfig]
    """Merge method and its parameters: {name: ..., its options}."""
    dtype: Literal["base", "float32", "bfloat16", "float16"] = "base"
    """Output dtype; base keeps each tensor's dtype."""

    @field_validator("method", mode="before")
    @classmethod
    def _resolve_method(cls, value: Any) -> MergeMethodConfig:
        return merge_method(value)

    @field_validator("method", mode="after")
    @classmethod
    def _fits_the_tasks(cls, method: MergeMethodConfig, info: ValidationInfo) -> MergeMethodConfig:
        """Per-task values come one per task; a weighted mean needs weights not summing to 0."""
        tasks: list[MergeTask] = info.data.get("tasks") or []
        for key in ("density", "drop_rate"):
            value = getattr(method, key, None)
            if tasks and isinstance(value, list) and len(value) != len(tasks):
                raise ValueError(
                    f"{method.name}.{key} has {len(value)} values for {len(tasks)} tasks"
                )
        linear = isinstance(method, LinearMerge) and method.normalize
        if linear and tasks and sum(t.weight for t in tasks) == 0:
            raise ValueError("linear: the tasks' weights sum to 0, so it cannot divide by them")
        return method


def load_merge_config(path: Path) -> MergeConfig:
    """YAML → :class:`MergeConfig`; any problem is one ConfigError line naming the field."""
    return load_merge_plan(path)[0]


def load_merge_plan(path: Path) -> tuple[MergeConfig, list[str]]:
    """A merge YAML in forgetless's schema, or a mergekit one (it names ``merge_method``),
    translated by ``mergekit_yaml``; with the translation's notes on what differs from mergekit."""
    from forgetless.config.loading import format_validation_error, read_yaml
    from forgetless.errors import ConfigError
    from forgetless.merging.mergekit_yaml import is_mergekit, translate

    data, notes = read_yaml(path), []
    if is_mergekit(data):
        found = translate(data, str(path))
        data, notes = found.config, found.notes
    try:
        return MergeConfig.model_validate(data), notes
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, str(path))) from None
