"""Which data an SAE reads by default: the general data outside the run's sequence (the instruct
tasks for an instruct sequence, the tiny suite's otherwise); explicit sources always win."""

from __future__ import annotations

from forgetless.cli.sae import _settings
from forgetless.config.loading import validate_config
from forgetless.config.presets import (
    DEMO_SEQUENCE,
    SMOLLM2_SEQUENCE,
    demo_config_dict,
    smollm2_config_dict,
)
from forgetless.tasks.builtin import BUILTIN_TASKS
from forgetless.tasks.instruct import INSTRUCT_TASKS

NO_OVERRIDES = dict.fromkeys(("expansion", "steps", "tasks"))


def test_a_named_model_reads_the_instruct_tasks_outside_its_sequence() -> None:
    cfg = validate_config(smollm2_config_dict())
    tasks = _settings(cfg, NO_OVERRIDES).tasks
    assert tasks and set(tasks) == set(INSTRUCT_TASKS) - set(SMOLLM2_SEQUENCE)


def test_the_tiny_base_reads_the_built_in_suite_outside_its_sequence() -> None:
    tasks = _settings(validate_config(demo_config_dict()), NO_OVERRIDES).tasks
    assert tasks == [name for name in BUILTIN_TASKS if name not in DEMO_SEQUENCE]


def test_explicit_sources_win() -> None:
    cfg = validate_config(smollm2_config_dict())
    assert _settings(cfg, {**NO_OVERRIDES, "tasks": ["it-json"]}).tasks == ["it-json"]
