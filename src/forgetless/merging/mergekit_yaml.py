"""A mergekit merge YAML (0.1.5) as a ``forgetless merge`` config: ``linear``,
``task_arithmetic``, ``ties``, ``dare_ties`` and ``dare_linear``, ``models`` with their
``weight`` and ``density``, the shared ``normalize``, ``int8_mask``, ``lambda``, ``rescale``,
and ``dtype``/``out_dtype``. Anything else is refused in one line that names it, rather than
merged otherwise than mergekit would.

How each method maps (mergekit's defaults, from ``merge_methods/registry.py``):

- ``linear`` → ``linear`` (normalize true); without ``base_model`` the first model is the base;
- ``task_arithmetic`` → ``task_arithmetic`` (normalize false), ``lambda`` → ``scaling``;
- ``ties`` → ``ties`` in mergekit's convention (normalize true, density 1 unless given);
- ``dare_ties``/``dare_linear`` → ``dare`` with ``drop_rate = 1 − density``, ``rescale: l1``
  (mergekit's ``rescale: true``, its default) or ``none``, ``elect_sign`` for ``dare_ties``
  (normalize false).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgetless.errors import ConfigError

METHODS = ("linear", "task_arithmetic", "ties", "dare_ties", "dare_linear")
TOP_KEYS = (
    "merge_method",
    "base_model",
    "models",
    "parameters",
    "dtype",
    "out_dtype",
    "tokenizer_source",
)
PER_MODEL = {
    "linear": ("weight",),
    "task_arithmetic": ("weight",),
    "ties": ("weight", "density"),
    "dare_ties": ("weight", "density"),
    "dare_linear": ("weight", "density"),
}
"""Parameters mergekit reads per model (or, as a default for every model, at the top level)."""
SHARED = {
    "linear": ("normalize",),
    "task_arithmetic": ("normalize", "lambda", "int8_mask"),
    "ties": ("normalize", "lambda", "int8_mask", "rescale"),
    "dare_ties": ("normalize", "lambda", "int8_mask", "rescale"),
    "dare_linear": ("normalize", "lambda", "int8_mask", "rescale"),
}
"""Parameters mergekit reads only from the top-level ``parameters``."""
NORMALIZE = {
    "linear": True,
    "task_arithmetic": False,
    "ties": True,
    "dare_ties": False,
    "dare_linear": False,
}
BOOLEANS = ("normalize", "int8_mask", "rescale")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Translation:
    """The forgetless merge config a mergekit YAML stands for (as data, for ``MergeConfig``),
    and what differs from running mergekit on it."""

    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def is_mergekit(data: dict[str, Any]) -> bool:
    """A mergekit config names its ``merge_method``; a forgetless one has ``method``."""
    return "merge_method" in data


def translate(data: dict[str, Any], source: str) -> Translation:
    """The mergekit config ``data`` (read from ``source``) as a forgetless merge; a key, value or
    method forgetless does not merge as mergekit does is one ConfigError line naming it."""
    try:
        return Translation(*_translate(data))
    except _Refused as err:
        raise ConfigError(f"{source}: {err}") from None


class _Refused(Exception):
    """A mergekit setting forgetless does not take; the message names its place."""


def _translate(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The forgetless merge config and the notes."""
    method = _method(data)
    shared = _shared(data, method)
    entries = _entries(data, method)
    _check_tokenizer(data)
    base = _model_path(data.get("base_model"), "base_model") if data.get("base_model") else None
    notes: list[str] = []
    if base is None:
        if method != "linear":
            raise _Refused(f"base_model: {method} needs a base_model (mergekit requires one)")
        base = entries[0][1]
    elif method != "linear":  # mergekit merges a listed base as the base, its parameters unread
        entries = [e for e in entries if not _same_model(e[1], base)]
        if not entries:
            raise _Refused("models: every model is the base_model; there is nothing to merge")
    elif not any(_same_model(e[1], base) for e in entries):
        notes.append(
            "base_model is not among the models: it is only the reference the updates are taken "
            "from (mergekit 0.1.5 asks for a weight for it instead)"
        )
    models = _weighted(entries, shared)
    config = {
        "base_model": base,
        "tasks": [{"path": path, "weight": weight} for path, weight, _ in models],
        "method": _native_method(method, shared, [d for _, _, d in models]),
        "dtype": _dtype(data, notes),
    }
    return config, [f"read as mergekit's {method}", *notes, *_method_notes(method)]


def _method(data: dict[str, Any]) -> str:
    unknown = [str(k) for k in data if k not in TOP_KEYS]
    if unknown:
        raise _Refused(
            f"mergekit key(s) {', '.join(unknown)} not supported by forgetless merge "
            f"(it reads {', '.join(TOP_KEYS)})"
        )
    method = data["merge_method"]
    if method not in METHODS:
        raise _Refused(
            f"merge_method {method!r} is not supported by forgetless merge "
            f"(supported: {', '.join(METHODS)})"
        )
    return str(method)


def _shared(data: dict[str, Any], method: str) -> dict[str, Any]:
    """The top-level ``parameters``: defaults of the per-model ones, and the shared ones."""
    params = _mapping(data.get("parameters"), "parameters")
    allowed = (*PER_MODEL[method], *SHARED[method])
    for key, value in params.items():
        if key not in allowed:
            raise _Refused(
                f"parameters.{key}: not a parameter forgetless merge takes for {method} "
                f"(it takes {', '.join(allowed)})"
            )
        _check_value(value, f"parameters.{key}", boolean=key in BOOLEANS)
    return params


def _entries(data: dict[str, Any], method: str) -> list[tuple[str, str, dict[str, Any]]]:
    """Each model's place in the file, path and checked parameters."""
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise _Refused("models: a list of {model: PATH, parameters: {...}} is needed")
    out = []
    for index, entry in enumerate(models):
        where = f"models[{index}]"
        entry = _mapping(entry, where)
        extra = [str(k) for k in entry if k not in ("model", "parameters")]
        if extra:
            raise _Refused(f"{where}.{extra[0]}: not supported (a model takes model, parameters)")
        params = _mapping(entry.get("parameters"), f"{where}.parameters")
        for key, value in params.items():
            _check_model_key(key, method, f"{where}.parameters")
            _check_value(value, f"{where}.parameters.{key}", boolean=False)
        out.append((where, _model_path(entry.get("model"), f"{where}.model"), params))
    return out


def _weighted(
    entries: list[tuple[str, str, dict[str, Any]]], defaults: dict[str, Any]
) -> list[tuple[str, float, float]]:
    """Each model's path, weight and density (the top-level value where it sets none)."""
    out = []
    for where, path, params in entries:
        weight = params.get("weight", defaults.get("weight"))
        if weight is None:
            raise _Refused(f"{where}.parameters.weight: missing (mergekit requires a weight)")
        density = float(params.get("density", defaults.get("density", 1.0)))
        if not 0 < density <= 1:
            raise _Refused(f"{where}: density {density} is outside (0, 1]")
        out.append((path, float(weight), density))
    return out


def _check_model_key(key: str, method: str, where: str) -> None:
    if key in SHARED[method]:
        raise _Refused(f"{where}.{key}: mergekit reads {key} only under the top-level parameters")
    if key not in PER_MODEL[method]:
        raise _Refused(
            f"{where}.{key}: not a parameter forgetless merge takes for {method} "
            f"(a model takes {', '.join(PER_MODEL[method])})"
        )


def _check_value(value: Any, where: str, boolean: bool) -> None:
    """A plain number (or boolean): mergekit's gradients (lists) and filters are refused."""
    if isinstance(value, list | dict):
        raise _Refused(f"{where}: gradients and filters are not supported; give one value")
    if boolean and not isinstance(value, bool):
        raise _Refused(f"{where}: must be true or false, got {value!r}")
    if not boolean and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise _Refused(f"{where}: must be a number, got {value!r}")


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Refused(f"{where}: must be a mapping, got {type(value).__name__}")
    return value


def _model_path(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _Refused(f"{where}: give a local model folder (a path)")
    if "+" in value:
        raise _Refused(
            f"{where}: {value!r} (a LoRA applied to a model) is not supported; list the adapter "
            "folder itself"
        )
    return value


def _same_model(a: str, b: str) -> bool:
    return a == b or Path(a).resolve() == Path(b).resolve()


def _native_method(method: str, shared: dict[str, Any], densities: list[float]) -> dict[str, Any]:
    normalize = bool(shared.get("normalize", NORMALIZE[method]))
    if method == "linear":
        return {"name": "linear", "normalize": normalize}
    scaling = float(shared.get("lambda", 1.0))
    if scaling < 0:
        raise _Refused(f"parameters.lambda: {scaling} must be ≥ 0 in forgetless merge")
    if method == "task_arithmetic":
        return {"name": "task_arithmetic", "scaling": scaling, "normalize": normalize}
    one = densities[0] if len(set(densities)) == 1 else densities
    rescale = bool(shared.get("rescale", method != "ties"))
    if method == "ties":
        if rescale:
            raise _Refused("parameters.rescale: true is not supported for ties")
        return {
            "name": "ties",
            "convention": "mergekit",
            "density": one,
            "normalize": normalize,
            "scaling": scaling,
        }
    drop = [1.0 - d for d in densities]
    return {
        "name": "dare",
        "drop_rate": drop[0] if len(set(drop)) == 1 else drop,
        "rescale": "l1" if rescale else "none",
        "elect_sign": method == "dare_ties",
        "normalize": normalize,
        "scaling": scaling,
    }


def _dtype(data: dict[str, Any], notes: list[str]) -> str:
    """forgetless computes in float32 and writes ``out_dtype`` (else ``dtype``, else each base
    tensor's dtype); mergekit computes in ``dtype``."""
    names = {}
    for key in ("dtype", "out_dtype"):
        value = data.get(key)
        if value is None:
            continue
        name = str(value).removeprefix("torch.")
        if name not in DTYPES:
            raise _Refused(f"{key}: {value!r} is not supported (supported: {', '.join(DTYPES)})")
        names[key] = name
    compute = names.get("dtype")
    if compute is not None and compute != "float32":
        notes.append(
            f"mergekit computes in {compute}; forgetless computes in float32, so the tensors "
            f"can differ by {compute} rounding"
        )
    return names.get("out_dtype", compute or "base")


def _check_tokenizer(data: dict[str, Any]) -> None:
    tokenizer = data.get("tokenizer_source")
    if tokenizer not in (None, "base"):
        raise _Refused(
            f"tokenizer_source: {tokenizer!r} is not supported (forgetless copies the base's)"
        )


def _method_notes(method: str) -> list[str]:
    if method == "linear":
        return [
            "linear is formed as θ₀ + Σ w τ / Σ w from the task vectors (mergekit: Σ w θ / Σ w): "
            "equal up to float32 rounding"
        ]
    if method.startswith("dare"):
        return [
            "DARE masks: forgetless draws its own (seed 0, one generator per tensor and model); "
            "mergekit draws from torch's global generator, so the kept entries differ (same "
            "distribution) unless every density is 1"
        ]
    return []
