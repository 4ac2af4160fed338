"""Config fields are described by the docstring under each: the CLI, the JSON schema and the
conformance checks read those descriptions from pydantic."""

from __future__ import annotations

from forgetless.config.schema import RunConfig
from forgetless.merging.config import TiesParams
from forgetless.methods.ties import TiesConfig
from forgetless.strict import DocumentedModel, StrictModel


class _Mixin(DocumentedModel):
    width: int = 3
    """How wide."""


class _Section(StrictModel, _Mixin):
    depth: int = 2
    """How deep, over
    two lines."""


def test_a_field_docstring_becomes_its_description() -> None:
    fields = _Section.model_fields
    assert fields["depth"].description == "How deep, over\ntwo lines."
    assert fields["width"].description == "How wide."


def test_a_mixin_s_descriptions_reach_the_configs_built_on_it() -> None:
    assert (
        TiesConfig.model_fields["density"].description
        == TiesParams.model_fields["density"].description
    )
    assert TiesParams.model_fields["density"].description


def test_the_run_schema_carries_the_descriptions() -> None:
    schema = RunConfig.model_json_schema()
    assert schema["properties"]["seed"]["description"] == RunConfig.model_fields["seed"].description
    assert schema["properties"]["seed"]["description"]
