"""The base of every config model: unknown keys, non-finite numbers and booleans-as-numbers are
refused at validation, before anything runs."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

STRICT_CONFIG = ConfigDict(
    extra="forbid", protected_namespaces=(), allow_inf_nan=False, use_attribute_docstrings=True
)


def _leaf_types(annotation: Any) -> set[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _leaf_types(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return {t for arg in typing.get_args(annotation) for t in _leaf_types(arg)}
    return {annotation}


def is_number_field(annotation: Any) -> bool:
    """An int or float field that does not also take a boolean."""
    leaves = _leaf_types(annotation)
    return bool(leaves & {int, float}) and bool not in leaves


class DocumentedModel(BaseModel):
    """A model whose fields are described by the docstring under each (the base of config
    mixins; ``StrictModel`` reads them too)."""

    model_config = ConfigDict(use_attribute_docstrings=True)


class StrictModel(BaseModel):
    """A pydantic model that rejects unknown keys, inf/NaN, and ``yes``/``on``/``true`` for numbers
    (YAML reads those as booleans, and pydantic's lax mode would take them as 1)."""

    model_config = STRICT_CONFIG

    @model_validator(mode="before")
    @classmethod
    def _no_bool_as_number(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                if isinstance(value, bool) and field and is_number_field(field.annotation):
                    raise ValueError(f"{key}: expected a number, got the boolean {value}")
        return data


class MethodConfig(StrictModel):
    """Base of every method's config; subclasses pin ``name`` to a ``Literal``."""

    name: str
