"""Fuzzing the JSONL and config loaders: any input gives a result or a one-line ForgetlessError."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from forgetless.config.loading import apply_override, read_yaml, validate_config
from forgetless.config.schema import RunConfig
from forgetless.errors import ConfigError, DataError, ForgetlessError
from forgetless.tasks.base import Example
from forgetless.tasks.loaders import read_jsonl

# FLUSH: no subnormal floats, since a Runner earlier in the session turns on
# torch.set_flush_denormal for the process and hypothesis then refuses to draw them.
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCRATCH = Path(tempfile.mkdtemp(prefix="forgetless-fuzz-"))  # one file rewritten per example

# Keys and values that real configs and records use, so that random documents reach the
# validators and not only the first "unknown key" check.
KEYS = [
    "prompt", "completion", "messages", "role", "content", "choices", "label", "tasks", "probes",
    "train", "eval", "model", "method", "name", "builtin", "jsonl", "hf", "path", "scorer",
    "kind", "lm_eval", "finetune", "lora", "mode", "regime", "lr", "steps", "seed", "n_eval",
    "target_modules", "name_or_path", "on_nonfinite", "max_length", "user", "assistant",
]  # fmt: skip
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False)  # see FLUSH below
    | st.sampled_from([*KEYS, "seq_ft", "replay", "ewc", "lora", "full", "reverse", "copy"])
    | st.text(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=25,
)


def _one_line(err: ForgetlessError) -> None:
    assert str(err) and "\n" not in str(err), repr(err)


def _read_jsonl_bytes(data: bytes) -> None:
    path = SCRATCH / "data.jsonl"
    path.write_bytes(data)
    try:
        examples = read_jsonl(path)
    except DataError as err:
        _one_line(err)
        assert str(err).startswith(str(path))
    else:
        assert examples and all(isinstance(e, Example) for e in examples)


@FUZZ
@given(st.binary(max_size=300))
@example(b"\xff\xfe{}\n")  # not UTF-8
@example(b"[" * 1200)  # nesting deeper than the recursion limit
@example(b"1" * 5000)  # an integer over Python's digit limit
def test_jsonl_random_bytes(data: bytes) -> None:
    _read_jsonl_bytes(data)


@FUZZ
@given(st.lists(VALUES, min_size=1, max_size=5))
@example([{"prompt": "a", "completion": "b"}])
@example([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
@example([{"prompt": "a", "choices": ["x", "y"], "label": 1}])
def test_jsonl_random_records(records: list[Any]) -> None:
    _read_jsonl_bytes(
        "\n".join(json.dumps(r, allow_nan=True) for r in records).encode("utf-8") + b"\n"
    )


def _read_yaml_bytes(data: bytes) -> None:
    path = SCRATCH / "config.yaml"
    path.write_bytes(data)
    try:
        raw = read_yaml(path)
    except ConfigError as err:
        _one_line(err)
        return
    assert isinstance(raw, dict)
    _validate(raw)


def _validate(raw: Any) -> None:
    try:
        cfg = validate_config(raw, "fuzz.yaml")
    except ConfigError as err:
        _one_line(err)
        assert str(err).startswith("fuzz.yaml: ")
    else:
        assert isinstance(cfg, RunConfig)


@FUZZ
@given(st.binary(max_size=300))
@example(b"\xff: 1\n")  # not UTF-8
@example(b"seed: 2024-13-45\n")  # a date YAML resolves but Python refuses
@example(b"[" * 1200)  # deeper than the recursion limit
def test_config_random_bytes(data: bytes) -> None:
    _read_yaml_bytes(data)


@FUZZ
@given(st.text(alphabet=st.sampled_from(list("{}[]:,-'\"#&*!|>%@ \n\tab01.e")), max_size=120))
def test_config_random_yaml_like_text(text: str) -> None:
    _read_yaml_bytes(text.encode("utf-8"))


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6))
@example({"tasks": ["reverse"], "method": {"name": [1]}})
@example({"tasks": ["reverse"], "method": {"name": {"a": 1}}})
@example({"tasks": [{"builtin": ["x"]}]})
@example({"tasks": ["reverse"], "probes": [{"lm_eval": [1]}]})
@example({"tasks": [{"builtin": "copy", "scorer": [1]}]})
def test_config_random_documents(raw: dict[str, Any]) -> None:
    _read_yaml_bytes(yaml.safe_dump(raw, allow_unicode=True).encode("utf-8"))
    _validate(raw)


@FUZZ
@given(st.text(max_size=40))
def test_random_overrides(assignment: str) -> None:
    data: dict[str, Any] = {"tasks": ["reverse"], "train": {"lr": 1e-3}}
    try:
        apply_override(data, assignment)
    except ConfigError as err:
        _one_line(err)
        return
    _validate(data)
