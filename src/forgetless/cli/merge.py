"""``forgetless merge CONFIG --out DIR``: merge task checkpoints or adapters into a base model.

CONFIG is forgetless's merge YAML or a mergekit one (it names ``merge_method``); ``--dry-run``
prints the plan and writes nothing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

if TYPE_CHECKING:
    from forgetless.merging.config import MergeConfig

console = Console()


def merge(
    config: Annotated[
        Path,
        typer.Argument(
            help="Merge YAML: forgetless's (base_model, tasks, method) or mergekit's "
            "(merge_method, base_model, models, parameters, dtype)."
        ),
    ],
    out: Annotated[Path | None, typer.Option(help="Output folder (a loadable HF model).")] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print the plan (method, models, dtype); write nothing."),
    ] = False,
) -> None:
    """Merge layer by layer from safetensors; writes config, tokenizer and model.safetensors."""
    from forgetless.errors import ConfigError
    from forgetless.merging.config import load_merge_plan
    from forgetless.merging.streaming import checked_inputs

    cfg, notes = load_merge_plan(config)  # imports a declared merge method's module when named
    if dry_run:
        checked_inputs(cfg)  # a plan printed is one that merges
        for line in plan_lines(cfg, notes):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        return
    if out is None:
        raise ConfigError("merge: --out DIR is needed (or --dry-run to print the plan)")
    _run(cfg, out)
    for note in notes:
        console.print(f"  note: {note}", markup=False, highlight=False, soft_wrap=True)


def _run(cfg: MergeConfig, out: Path) -> None:
    from forgetless.merging.streaming import stream_merge

    stats = stream_merge(cfg, out)
    extra = ""
    if stats.layers:
        conflicts = [v["conflict"] for v in stats.layers.values()]
        mean = sum(conflicts) / len(conflicts)
        extra = f"; mean conflict {mean:.4f} over {len(conflicts)} layers"
    if "opcm_lambda" in stats.scalars:
        extra = f"; λ = {stats.scalars['opcm_lambda']:.4f}"
    console.print(f"merged {len(cfg.tasks)} task(s) by {cfg.method.name} into {out}{extra}")
    for task, changed in zip(cfg.tasks, stats.changed, strict=True):
        note = "  (warning: the task changes nothing)" if changed == 0 else ""
        console.print(
            f"  {task.path}: changed {changed} of {stats.tensors} tensors{note}", markup=False
        )


def plan_lines(cfg: MergeConfig, notes: list[str]) -> list[str]:
    """What ``forgetless merge`` would do with ``cfg``: method and options, base, each task's
    weight (and density where each has its own), output dtype, the base's tensor count."""
    options = cfg.method.model_dump(mode="json", exclude={"name"})
    per_task = {k: v for k, v in options.items() if isinstance(v, list)}
    shown = ", ".join(f"{k} {_text(v)}" for k, v in options.items() if k not in per_task)
    lines = ["plan (dry run: nothing is written)", f"  method: {cfg.method.name} ({shown})"]
    lines.append(f"  base:   {cfg.base_model}  {_size(cfg.base_model)}")
    for index, task in enumerate(cfg.tasks):
        own = "".join(f"  {k} {v[index]}" for k, v in per_task.items())
        lines.append(f"  task {index + 1}: {task.path}  weight {task.weight}{own}")
    lines.append(f"  output dtype: {cfg.dtype} (arithmetic in float32)")
    lines.extend(f"  note: {note}" for note in notes)
    return lines


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _size(folder: Path) -> str:
    """``(N tensors, M parameters)`` from the safetensors headers, or why not."""
    from forgetless.core.storage import tensor_shapes
    from forgetless.errors import ForgetlessError

    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return "(no safetensors weights found)"
    try:
        shapes = {k: v for f in files for k, v in tensor_shapes(f).items()}
    except ForgetlessError as err:
        return f"(unreadable: {err})"
    params = sum(math.prod(shape) for shape in shapes.values())
    return f"({len(shapes)} tensors, {params:,} parameters)"
