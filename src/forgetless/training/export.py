"""A finished run's model as a plain model folder, and the run-folder readers the diagnostics
share.

``export_model`` rebuilds the model after any finished task from the run's checkpoints, folds
LoRA adapters into the weights and saves a transformers folder (safetensors weights, tokenizer,
chat template): ``diagnose circuits``, transformers or mergekit open it without forgetless.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from torch import nn

from forgetless.config.loading import validate_config
from forgetless.config.schema import RunConfig
from forgetless.contract.method import Capability, create_method
from forgetless.core.ownership import check_output_folder, folder_owner, replace_output
from forgetless.core.rundir import RunDir
from forgetless.core.storage import atomic_write_json
from forgetless.errors import CheckpointError

EXPORT_RECORD = "export.json"


class RunFolderError(CheckpointError):
    """A run folder that lacks what is asked of it (config, results, a checkpoint)."""


def load_run(run_dir: Path) -> tuple[RunConfig, dict[str, Any]]:
    """A run folder's validated config and its results."""
    config_path, results_path = RunDir(run_dir).config, RunDir(run_dir).results
    for path in (config_path, results_path):
        if not path.is_file():
            raise RunFolderError(f"{run_dir}: missing {path.name}")
    cfg = validate_config(yaml.safe_load(config_path.read_text(encoding="utf-8")), str(config_path))
    return cfg, json.loads(results_path.read_text(encoding="utf-8"))


def checkpoint_model(
    cfg: RunConfig, run_dir: Path, task_names: list[str], upto: int
) -> tuple[nn.Module, Any]:
    """A fresh model with the run's state after task ``upto`` (1-based), in eval mode."""
    from forgetless.models.finetuner import Finetuner
    from forgetless.models.loading import load_model_and_tokenizer
    from forgetless.training.pretrain import ensure_base_model

    source = cfg.model.name_or_path or str(ensure_base_model(cfg.model, Console(quiet=True)))
    model, tokenizer = load_model_and_tokenizer(cfg.model, source)
    method = create_method(cfg.method)
    if method.uses(Capability.MODEL_SETUP):  # the architecture the saved weights expect
        method.setup_model(model)
    finetuner = Finetuner(model, cfg.finetune)
    ckpts = RunDir(run_dir).task_checkpoints(task_names[:upto])
    missing = [c for c in ckpts if not c.is_dir()]
    if missing:
        raise RunFolderError(f"{run_dir}: missing checkpoint {missing[0].name}")
    finetuner.restore(ckpts)
    return finetuner.model.eval(), tokenizer


TASK_CHECKPOINT = re.compile(r"task-(\d+)-")


def run_folder_advice(folder: Path) -> str | None:
    """Why ``folder`` is no model when it is a run folder or one of its task checkpoints (they
    hold weights, not a loadable model), and the export that makes one; None otherwise."""
    if not folder.is_dir() or (folder / "config.json").is_file():
        return None
    if folder_owner(folder) == "run":
        return (
            f"{folder} is a forgetless run folder, not a model; export its model first: "
            f"forgetless export {folder} OUT (--task N for an earlier task's)"
        )
    run, index = folder.parent.parent, TASK_CHECKPOINT.match(folder.name)
    if folder.parent.name == "checkpoints" and index and folder_owner(run) == "run":
        return (
            f"{folder} is a task checkpoint of the run {run}, not a model; export it first: "
            f"forgetless export {run} OUT --task {int(index.group(1))}"
        )
    return None


def export_model(run_dir: Path, out: Path, task: int | None = None) -> dict[str, Any]:
    """Save the model after task ``task`` (1-based; default the last finished) to ``out``.

    ``out`` must be new, empty or an earlier export (``core.ownership``); it is written whole or
    not at all. Returns the record written beside the weights (run, task, base model, whether
    adapters were folded in).
    """
    from forgetless.training.runner import load_tasks

    check_output_folder(out, "export", [run_dir], place="OUT")
    cfg, results = load_run(run_dir)
    names = [t.name for t in load_tasks(cfg.tasks, cfg)]
    done = int(results.get("completed_tasks", 0))
    upto = done if task is None else task
    if not 1 <= upto <= done:
        raise RunFolderError(f"{run_dir}: --task {upto} is not a finished task (1..{done})")
    model, tokenizer = checkpoint_model(cfg, run_dir, names, upto)
    folded = hasattr(model, "merge_and_unload")
    if folded:
        model = model.merge_and_unload()  # type: ignore[operator]
    record = {
        "run": str(run_dir),
        "after_task": upto,
        "task": names[upto - 1],
        "base_model": cfg.model.name_or_path or "built-in tiny base",
        "finetune": cfg.finetune.mode,
        "lora_folded_in": folded,
    }
    with replace_output(out, "export", [run_dir], place="OUT") as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)  # type: ignore[operator]
        tokenizer.save_pretrained(str(tmp))
        atomic_write_json(tmp / EXPORT_RECORD, record)
    return record
