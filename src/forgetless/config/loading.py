"""YAML loading, dotted ``key=value`` overrides, and one-line validation errors."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from forgetless.config.bounds import check_fits
from forgetless.config.schema import RunConfig
from forgetless.core import registry
from forgetless.errors import ConfigError


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing file or a syntax error is a ConfigError naming the place."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{where}: invalid YAML: {problem}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start + 1})") from None
    except (ValueError, RecursionError) as err:  # e.g. a date like 2024-13-45, deep nesting
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{path}: invalid YAML value: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b.0.c=value`` in place; the value is parsed as YAML (``1e-4``, ``[a, b]``)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {assignment!r} must look like key.path=value")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        raise ConfigError(f"override {assignment!r}: value is not valid YAML") from None
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        node = _child(node, part, parts[: i + 1], assignment, create=not parts[i + 1].isdigit())
    _assign(node, parts[-1], value, assignment)


def _child(node: Any, part: str, path: list[str], assignment: str, create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, assignment)]
    if not isinstance(node, dict):
        raise ConfigError(f"override {assignment!r}: {'.'.join(path[:-1])} is not a mapping")
    if part not in node or node[part] is None:
        node[part] = {} if create else []
    return node[part]


def _assign(node: Any, part: str, value: Any, assignment: str) -> None:
    if isinstance(node, list):
        node[_index(node, part, assignment)] = value
    elif isinstance(node, dict):
        node[part] = value
    else:
        raise ConfigError(f"override {assignment!r}: cannot set a key on a {type(node).__name__}")


def _index(node: list[Any], part: str, assignment: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override {assignment!r}: {part!r} is not an index below {len(node)}")
    return int(part)


PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")
"""What pydantic puts before a validator's own message: noise on a line read by a person."""


def format_validation_error(
    err: ValidationError, source: str, root: type[BaseModel] | None = None, data: Any = None
) -> str:
    """All of a ValidationError on one line: ``source: field.path: message; ...``; with the
    ``root`` model, an unknown field gets the closest known name (``did you mean``), a method's
    option the closest of its method's options (named in ``data``, the input validated)."""
    parts = []
    for item in err.errors():
        loc = ".".join(_printable(p) for p in item["loc"] if not _is_union_tag(p)) or "<root>"
        msg = " ".join(str(item["msg"]).split())
        msg = next((msg[len(p) :] for p in PYDANTIC_PREFIXES if msg.startswith(p)), msg)
        if root is not None and item["type"] == "extra_forbidden" and item["loc"]:
            known = _known_fields(root, item["loc"][:-1], data)
            msg += registry.did_you_mean(str(item["loc"][-1]), known)
        parts.append(f"{loc}: {msg}")
    return f"{source}: " + "; ".join(parts)


def _known_fields(root: type[BaseModel], loc: tuple[Any, ...], data: Any) -> list[str]:
    """The field names at ``loc``; under a run's ``method``, those of the method it names."""
    entry = data.get("method") if isinstance(data, dict) else None
    name = entry.get("name") if isinstance(entry, dict) else None
    if root is RunConfig and loc == ("method",) and isinstance(name, str):
        method = registry.lookup(name)
        if method is not None:
            return sorted(method.config_cls.model_fields)
    return fields_at(root, loc)


def fields_at(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the model(s) at ``loc`` under ``root`` (list items and union tags
    followed), or none when the path leaves the models."""
    models = [root]
    for part in loc:
        if isinstance(part, int):
            continue
        if _is_union_tag(part):
            models = [m for m in models if m.__name__ == part] or models
            continue
        models = [
            inner
            for m in models
            if part in m.model_fields
            for inner in _models_in(m.model_fields[part].annotation)
        ]
    return sorted({name for m in models for name in m.model_fields})


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through Optional, unions, lists, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _printable(part: Any) -> str:
    """A location part as it reads on one line: a key with spaces or control characters quoted."""
    text = str(part)
    return text if text.isprintable() and text.strip() == text and text else repr(text)


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and part.endswith("Config") and part[:1].isupper()


def validate_config(data: dict[str, Any], source: str = "config") -> RunConfig:
    """The config, or a one-line ConfigError: a bad value, or sizes the machine cannot hold."""
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source, RunConfig, data)) from None
    check_fits(config, source)
    return config


PRESET_KEY = "preset"
"""A config file's key naming the preset its own keys sit on."""


@dataclass
class RawConfig:
    """A config's data before validation, and what a preset put in it."""

    data: dict[str, Any]
    preset: str | None = None
    """The preset under the file (or the whole config when no file is given)."""
    supplied: list[str] = field(default_factory=list)
    """Dotted keys the preset set that neither the file nor an override did."""

    def override(self, assignments: list[str]) -> None:
        for assignment in assignments:
            apply_override(self.data, assignment)
            key = assignment.partition("=")[0]
            self.supplied = [k for k in self.supplied if k != key and not k.startswith(key + ".")]


def raw_config(path: Path | None, preset: str | None = None) -> RawConfig:
    """The raw config: a YAML file (on the preset its ``preset:`` key or ``preset`` names,
    ``preset`` winning), or the preset alone (``tiny`` by default) when no file is given."""
    from forgetless.config.presets import layered, preset_config, supplied_keys

    if path is None:
        name = preset or "tiny"
        return RawConfig(preset_config(name, "--preset"), name)
    own = copy.deepcopy(read_yaml(path))
    named = own.pop(PRESET_KEY, None)
    name = preset or named
    if name is None:
        return RawConfig(own)
    where = "--preset" if preset else f"{path}: {PRESET_KEY}"
    base = preset_config(name, where)
    return RawConfig(layered(base, own), name, supplied_keys(base, own))


def config_source(path: Path | None, preset: str | None) -> str:
    """How a config is named in messages: its file, or the preset it is."""
    return str(path) if path is not None else f"preset {preset or 'tiny'}"


def load_raw_config(
    path: Path | None, overrides: list[str] | None = None, preset: str | None = None
) -> tuple[RunConfig, RawConfig]:
    """The config validated whole (its ``bench:`` section typed), and its raw data without
    that section (what a bench's variants start from), with what a preset supplied."""
    raw = raw_config(path, preset)
    raw.override(overrides or [])
    config = validate_config(raw.data, config_source(path, preset))
    raw.data.pop("bench", None)
    return config, raw


def load_config_data(
    path: Path | None, overrides: list[str] | None = None, preset: str | None = None
) -> tuple[RunConfig, dict[str, Any]]:
    """The one loader of run and bench files: a YAML config (on a preset, see ``raw_config``)
    with overrides, validated whole, and its raw data without the ``bench:`` section."""
    config, raw = load_raw_config(path, overrides, preset)
    return config, raw.data


def load_config(
    path: Path | None, overrides: list[str] | None = None, preset: str | None = None
) -> RunConfig:
    """Load a YAML config (or a built-in preset when ``path`` is None) and apply overrides."""
    return load_raw_config(path, overrides, preset)[0]


def dump_config(config: RunConfig) -> str:
    # libyaml writes the same text as the Python dumper, three times faster (10^4 tasks: 5 s)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(config.model_dump(mode="json"), Dumper=dumper, sort_keys=False)
