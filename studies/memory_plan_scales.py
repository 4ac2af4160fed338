"""The memory plan (``forgetless.models.memory_plan``, what ``forgetless validate --memory``
prints) at 1B, 7B and 70B: each method's predicted peak per device, activations included,
under LoRA, LoRA with gradient checkpointing, QLoRA and full fine-tuning, rendered into
docs/performance.md from ``studies/memory_plan_scales.yaml``. The models are built on the meta
device from their config.json fields: no weight is read and nothing is downloaded."""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from forgetless.config.schema import RunConfig
from forgetless.models.memory_plan import GB, meta_model, plan_method, shape_of

HERE = Path(__file__).resolve().parent


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra``'s sections merged in, one level deep."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def peak_cell(run: dict[str, Any], method: str, model: Any, checkpointing: bool) -> str:
    """One method's planned peak in GB, or why the setting refuses it."""
    try:
        config = RunConfig.model_validate({**run, "method": {"name": method}})
    except ValidationError:
        return "refused"
    plan = plan_method(shape_of(model, config), config, config.method, checkpointing)
    return f"{plan.peak / GB:.1f}"


def render_plan_scales(spec_name: str) -> str:
    """The table: one row per model and method, one column per setting."""
    spec = yaml.safe_load((HERE / spec_name).read_text(encoding="utf-8"))
    settings = spec["settings"]
    lines = [
        "| model | method | " + " | ".join(s["label"] for s in settings) + " |",
        "|---|---|" + "---:|" * len(settings),
    ]
    with tempfile.TemporaryDirectory() as folder:
        for name, fields in spec["models"].items():
            (Path(folder) / name).mkdir()
            (Path(folder) / name / "config.json").write_text(json.dumps(fields), encoding="utf-8")
            base = merged(spec["run"], {"model": {"name_or_path": str(Path(folder) / name)}})
            model = meta_model(RunConfig.model_validate({**base, "method": {"name": "seq_ft"}}))
            for method in spec["methods"]:
                cells = [
                    peak_cell(merged(base, _without_label(s)), method, model, s["checkpointing"])
                    for s in settings
                ]
                lines.append(f"| {name} | `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _without_label(setting: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in setting.items() if k not in ("label", "checkpointing")}
