"""``forgetless merge CONFIG --out DIR``: merge task checkpoints or adapters into a base model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console()


def merge(
    config: Annotated[Path, typer.Argument(help="Merge YAML: base_model, tasks, method.")],
    out: Annotated[Path, typer.Option(help="Output folder (a loadable HF model).")],
) -> None:
    """Merge layer by layer from safetensors; writes config, tokenizer and model.safetensors."""
    from forgetless.merging.config import load_merge_config
    from forgetless.merging.streaming import stream_merge

    cfg = load_merge_config(config)  # imports a declared merge method's module when named
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
