"""Gated sparse autoencoders on the base model's last-layer MLP outputs (the space of sae_fd)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from forgetless.cli.options import PresetOpt, QuietOpt, SetOpt

if TYPE_CHECKING:
    import torch

    from forgetless.config.schema import RunConfig
    from forgetless.sae.train import SAETrainConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()

ConfigArg = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Argument(help="YAML run config (its model; its sae_fd settings); omit for the preset."),
]
TasksOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        help="Comma-separated built-in task names (default: the general data outside the "
        "config's sequence: the instruct tasks for an instruct sequence, else the tiny suite's)."
    ),
]


def _base_model(cfg: RunConfig, quiet: bool) -> tuple[Any, Any, torch.device, str]:
    """The run's base model (pretraining the tiny one first if needed), on the best device."""
    import torch

    from forgetless.models.loading import load_model_and_tokenizer, resolve_source
    from forgetless.training.pretrain import ensure_base_model

    source = cfg.model.name_or_path or str(ensure_base_model(cfg.model, console, not quiet))
    source = resolve_source(source)
    model, tokenizer = load_model_and_tokenizer(cfg.model, source)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)  # type: ignore[arg-type]
    return model, tokenizer, device, source


def _load_config(config: Path | None, set_: list[str] | None, preset: str | None) -> RunConfig:
    """The run config (a bench config's ``bench:`` section is typed and ignored here)."""
    from forgetless.config.loading import load_config

    return load_config(config, set_, preset)


def _task_list(tasks: str | None) -> list[str | dict[str, Any]] | None:
    names = [t.strip() for t in (tasks or "").split(",") if t.strip()]
    return list(names) or None


def _metrics_table(metrics: dict[str, dict[str, float]]) -> Table:
    table = Table("data", "tokens", "MSE", "explained variance", "L0", "dead features")
    for split, m in metrics.items():
        table.add_row(
            split,
            str(m["tokens"]),
            f"{m['mse']:.4g}",
            f"{m['explained_variance']:.4f}",
            f"{m['l0']:.2f}",
            f"{m['dead_fraction']:.2%}",
        )
    return table


def _settings(cfg: RunConfig, overrides: dict[str, Any]) -> SAETrainConfig:
    from pydantic import ValidationError

    from forgetless.config.loading import format_validation_error
    from forgetless.errors import ConfigError
    from forgetless.sae.train import SAETrainConfig

    start = getattr(cfg.method, "sae", None) if cfg.method.name == "sae_fd" else None
    base = start if isinstance(start, SAETrainConfig) else SAETrainConfig.model_validate({})
    chosen = {k: v for k, v in overrides.items() if v is not None}
    merged = {**base.model_dump(), **chosen}
    if merged["tasks"] is None:
        from forgetless.sae.activations import default_sae_sources

        merged["tasks"] = default_sae_sources([t.builtin or "" for t in cfg.tasks])
    try:
        return SAETrainConfig.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, "sae train options")) from None


@app.command()
def train(
    config: ConfigArg = None,
    set_: SetOpt = None,
    preset: PresetOpt = None,
    out: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Folder (default: the cache sae_fd reads for this base and settings)."),
    ] = None,
    expansion: Annotated[Optional[int], typer.Option(help="D / d.")] = None,  # noqa: UP045
    l1: Annotated[Optional[float], typer.Option(help="λ_sparse.")] = None,  # noqa: UP045
    steps: Annotated[Optional[int], typer.Option(help="Adam steps.")] = None,  # noqa: UP045
    batch_size: Annotated[Optional[int], typer.Option(help="Tokens per step.")] = None,  # noqa: UP045
    lr: Annotated[Optional[float], typer.Option(help="Learning rate.")] = None,  # noqa: UP045
    n_per_task: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(min=1, help="Examples per task."),
    ] = None,
    tasks: TasksOpt = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed.")] = None,  # noqa: UP045
    autocast: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="off or bf16: collect and train under bfloat16 autocast."),
    ] = None,
    skip_first: Annotated[
        Optional[bool],  # noqa: UP045
        typer.Option(help="Leave each example's first token (a chat model's sink) out."),
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Train a gated SAE on the base model's last-layer MLP outputs; save it with its config.

    Settings start from the config's sae_fd ``sae`` block (else the defaults); with no --out the
    SAE goes where an sae_fd run on the same base and settings looks for it, so a bench does not
    train it again.
    """
    from forgetless.core.ownership import check_output_folder, replace_output
    from forgetless.core.storage import cache_fill_lock
    from forgetless.engine.progress import Progress
    from forgetless.sae.activations import fit_sae, model_fingerprint, shared_sae_dir
    from forgetless.sae.gated import save_sae

    cfg = _load_config(config, set_, preset)
    if out is not None:
        check_output_folder(out, "sae", [config] if config else [])
    overrides = {
        "expansion": expansion,
        "l1_coeff": l1,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "n_per_task": n_per_task,
        "tasks": _task_list(tasks),
        "seed": seed,
        "autocast": autocast,
        "skip_first": skip_first,
    }
    settings = _settings(cfg, overrides)
    model, tokenizer, device, source = _base_model(cfg, quiet)
    max_length = cfg.train.resolved_max_length
    folder = out or shared_sae_dir(model_fingerprint(model, tokenizer), settings, max_length)
    with (
        Progress(console, enabled=not quiet) as bars,
        bars.task("train sae", settings.steps) as advance,
    ):
        sae, record = fit_sae(model, tokenizer, settings, max_length, device, on_step=advance)
    record["model"] = source
    folder.parent.mkdir(parents=True, exist_ok=True)
    with cache_fill_lock(folder), replace_output(folder, "sae") as tmp:
        save_sae(sae, tmp, record)
    console.print(
        f"gated SAE d={sae.d_in} → D={sae.d_sae} on {record['train_tokens']} tokens "
        f"({len(record['sources'])} sources)"
    )
    console.print(_metrics_table(record["metrics"]))
    console.print(f"saved: {folder}")


@app.command("eval")
def evaluate(
    sae_dir: Annotated[Path, typer.Argument(help="Folder with sae.safetensors + sae_config.json.")],
    config: ConfigArg = None,
    set_: SetOpt = None,
    preset: PresetOpt = None,
    tasks: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            help="Comma-separated built-in tasks (default: the CONFIG's tasks and "
            "probes, or every built-in task without a CONFIG)."
        ),
    ] = None,
    n_per_task: Annotated[int, typer.Option(min=1, help="Examples per task.")] = 300,
    split: Annotated[str, typer.Option(help="Which split of each task: eval or train.")] = "eval",
    seed: Annotated[int, typer.Option(help="Seed of the built-in data.")] = 0,
    quiet: QuietOpt = False,
) -> None:
    """Score a saved SAE on the base model's last-layer MLP outputs over the given data.

    Reconstruction MSE, explained variance, L0 and the dead-feature fraction."""
    from forgetless.errors import ConfigError
    from forgetless.sae.activations import collect_mlp_outputs, example_features, sae_examples
    from forgetless.sae.gated import load_sae, read_sae_record
    from forgetless.sae.train import sae_metrics

    if split not in ("eval", "train"):
        raise ConfigError(f"--split must be eval or train, not {split!r}")
    cfg = _load_config(config, set_, preset)
    model, tokenizer, device, _ = _base_model(cfg, quiet)
    try:
        sae = load_sae(sae_dir, device)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from None
    sources = _task_list(tasks)
    if sources is None and config is not None:
        sources = [
            t.model_dump(mode="json", exclude_none=True)
            for t in [*cfg.tasks, *cfg.probes]
            if not hasattr(t, "lm_eval")  # lm-eval probes have no examples of their own
        ]
    examples = sae_examples(sources, n_per_task, seed, split)
    features = example_features(examples, tokenizer, cfg.train.resolved_max_length)
    skip_first = bool(read_sae_record(sae_dir).get("train", {}).get("skip_first", False))
    acts = collect_mlp_outputs(
        model, features, tokenizer.pad_token_id, device, skip_first=skip_first
    )
    if acts.size(-1) != sae.d_in:
        raise ConfigError(
            f"the SAE encodes d={sae.d_in}, the model's MLP outputs d={acts.size(-1)}"
        )
    metrics = sae_metrics(sae, acts).as_dict()
    console.print(_metrics_table({f"{split} ({', '.join(examples)})": metrics}))
