from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from forgetless.config.loading import apply_override, load_config, validate_config
from forgetless.config.presets import demo_config_dict
from forgetless.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_demo_config_is_valid() -> None:
    cfg = validate_config(demo_config_dict())
    assert [t.display_name for t in cfg.tasks] == ["reverse", "cipher", "bracket"]
    assert cfg.method.name == "seq_ft"


def test_the_written_out_demo_is_the_built_in_demo() -> None:
    written = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text(encoding="utf-8"))
    assert validate_config(written) == validate_config(demo_config_dict())


def test_overrides_apply_before_validation() -> None:
    cfg = load_config(
        None, ["train.lr=1e-4", "tasks.0=count", "finetune.lora.r=4", "finetune.mode=lora"]
    )
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.tasks[0].builtin == "count"
    assert cfg.finetune.lora.r == 4


@pytest.mark.parametrize("bad", ["train.lr", "tasks.9=x", "=3"])
def test_malformed_override_is_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="override"):
        apply_override({"tasks": ["a"]}, bad)


def test_error_names_the_field_on_one_line() -> None:
    data = demo_config_dict()
    data["train"]["lr"] = "fast"
    data["train"]["batch_size"] = 0
    with pytest.raises(ConfigError) as info:
        validate_config(data, "x.yaml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("x.yaml: ")
    assert "train.lr" in message and "train.batch_size" in message


def test_unknown_key_and_unknown_method_are_rejected() -> None:
    data = demo_config_dict() | {"trian": {}}
    with pytest.raises(ConfigError, match="trian"):
        validate_config(data)
    data = demo_config_dict() | {"method": {"name": "magic"}}
    with pytest.raises(ConfigError, match=r"unknown method 'magic'; known: .*seq_ft"):
        validate_config(data)


def test_task_needs_exactly_one_source_and_unique_names() -> None:
    with pytest.raises(ConfigError, match="exactly one of builtin, jsonl, hf"):
        validate_config({"tasks": [{"builtin": "copy", "jsonl": {"train": "a.jsonl"}}]})
    with pytest.raises(ConfigError, match="repeated: copy"):
        validate_config({"tasks": ["copy"], "probes": ["copy"]})


def test_yaml_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("tasks: [reverse\nseed: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+:\d+: invalid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_example_configs_validate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from forgetless.cli.app import main

    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert examples, "examples/ must hold configs"
    for path in examples:  # the campaigns' configs: studies/tests/test_campaign_configs.py
        monkeypatch.setattr(sys, "argv", ["forgetless", "validate", str(path)])
        main()
        assert "ok:" in capsys.readouterr().out


def test_bad_bench_section_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"x.yaml: bench.seeds: Input should be greater"):
        validate_config({"tasks": ["reverse"], "bench": {"seeds": 0}}, "x.yaml")


def test_presets() -> None:
    tiny = load_config(None, preset="tiny")
    assert tiny.model.name_or_path is None and len(tiny.tasks) == 3
    with pytest.raises(ConfigError, match="unknown preset 'huge'; known: tiny"):
        load_config(None, preset="huge")


@pytest.mark.parametrize(
    "method, why",
    [
        ("ewc", "anchors weights by name"),
        ("attribution_gate", "keeps its map by parameter name"),
        ("ties", "merges the trainable weights"),
    ],
)
def test_validate_refuses_a_lora_regime_a_method_cannot_use_without_loading_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str, why: str
) -> None:
    from forgetless.cli.app import run_cli

    data = {
        "model": {"name_or_path": str(tmp_path / "no-such-model")},  # never loaded
        "finetune": {"mode": "lora", "lora": {"regime": "per_task"}},
        "tasks": ["reverse"],
        "method": {"name": method},
    }
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(data), encoding="utf-8")
    assert run_cli(["validate", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and why in err and "regime carry, not 'per_task'" in err


def test_finetune_takes_its_mode_alone() -> None:
    cfg = validate_config({"tasks": ["reverse"], "finetune": "lora"})
    assert cfg.finetune.mode == "lora" and cfg.finetune.lora.regime == "carry"
    with pytest.raises(ConfigError, match=r"^x.yaml: finetune.mode: .*'full' or 'lora'"):
        validate_config({"tasks": ["reverse"], "finetune": "qlora"}, "x.yaml")


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (
            {"train": {"batchsize": 3}},
            "train.batchsize: Extra inputs are not permitted; did you mean 'batch_size'?",
        ),
        (
            {"tasks": ["copy", {"builtin": "upper", "n_trian": 3}]},
            "tasks.1.n_trian: Extra inputs are not permitted; did you mean 'n_train'?",
        ),
        ({"eval": {"zzz": 1}}, "eval.zzz: Extra inputs are not permitted"),
        (
            {"tasks": ["copy"], "method": {"name": "ewc", "lamm": 3}},
            "method.lamm: Extra inputs are not permitted; did you mean 'lam'?",
        ),
        (
            {"tasks": ["copy"], "method": {"name": "sae_fd", "rhoo": 0.5}},
            "method.rhoo: Extra inputs are not permitted; did you mean 'rho'?",
        ),
        (
            {"tasks": ["copy", {"builtin": "upper", "scorer": "bogus"}]},
            "tasks.1.scorer: unknown scorer kind 'bogus'",
        ),
    ],
)
def test_a_config_error_reads_as_a_person_would_write_it(data: dict[str, Any], said: str) -> None:
    """No pydantic prefix before a validator's words; an unknown field gets the closest name."""
    with pytest.raises(ConfigError) as caught:
        validate_config(data, "c.yaml")
    message = str(caught.value)
    assert message.startswith(f"c.yaml: {said}") and "Value error" not in message, message
    if "zzz" in said:
        assert "did you mean" not in message
