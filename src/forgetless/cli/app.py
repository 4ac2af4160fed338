"""forgetless: train a task sequence, measure forgetting. Add --debug to any command to see a
traceback instead of a one-line error."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from forgetless.cli.check import check as check_command
from forgetless.cli.diagnose import app as diagnose_app
from forgetless.cli.merge import merge as merge_command
from forgetless.cli.options import PresetOpt, QuietOpt, SetOpt
from forgetless.cli.sae import app as sae_app
from forgetless.errors import ForgetlessError

if TYPE_CHECKING:
    from forgetless.config.loading import RawConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
app.add_typer(sae_app, name="sae")
app.add_typer(diagnose_app, name="diagnose")
app.command(name="merge")(merge_command)
app.command(name="check")(check_command)
console = Console()
err_console = Console(stderr=True)

ConfigArg = Annotated[Path | None, typer.Argument(help="YAML config; omit for the built-in demo.")]


@app.command()
def run(
    config: ConfigArg = None,
    out: Annotated[Path | None, typer.Option(help="Output folder (default runs/<name>).")] = None,
    set_: SetOpt = None,
    allow_config_change: Annotated[
        bool, typer.Option(help="Resume even if the config changed.")
    ] = False,
    quiet: QuietOpt = False,
    preset: PresetOpt = None,
    threads: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(
            min=1, help="CPU threads (default: torch's, one per core; fewer on a busy machine)."
        ),
    ] = None,
) -> None:
    """Train the task sequence, evaluating after each task; re-run to resume."""
    import os

    from forgetless.config.bounds import size_warnings
    from forgetless.config.loading import config_source, load_raw_config
    from forgetless.engine.progress import line_interval

    cfg, raw = load_raw_config(config, set_, preset)
    line_interval()  # a bad $FORGETLESS_PROGRESS_EVERY fails before anything loads
    out_dir = out or Path("runs") / (config.stem if config else preset or "tiny")
    if not quiet and os.environ.get("RANK", "0") == "0":  # said before torch loads (seconds)
        layer = f" on preset {raw.preset}" if config and raw.preset else ""
        console.print(
            f"run: {config_source(config, preset)}{layer} → {out_dir}, method {cfg.method.name}, "
            f"{len(cfg.tasks)} tasks; loading",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )

    from forgetless.core.distributed import is_main_process
    from forgetless.core.ownership import check_output_folder
    from forgetless.report.table import accuracy_table, metrics_table
    from forgetless.training.runner import Runner

    check_output_folder(out_dir, "run", [config] if config else [])
    for line in size_warnings(cfg, config_source(config, preset)):
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    results = Runner(
        cfg, out_dir, console, progress=not quiet, allow_config_change=allow_config_change
    ).run()
    if not is_main_process():  # under accelerate launch, one process reports
        return
    data = results.to_json()
    console.print(accuracy_table(data))
    console.print(metrics_table(data))
    console.print(f"results: {out_dir / 'results.json'}")


@app.command()
def validate(
    config: Annotated[
        Path | None, typer.Argument(help="YAML config to check; omit to check the preset.")
    ] = None,
    set_: SetOpt = None,
    preset: PresetOpt = None,
    fsdp: Annotated[
        bool,
        typer.Option(
            "--fsdp", help="Also check that the run can be sharded (an FSDP version 2 launch)."
        ),
    ] = False,
    zero: Annotated[
        bool,
        typer.Option("--zero", help="Also check that the run can go through DeepSpeed ZeRO-1/2."),
    ] = False,
    memory: Annotated[
        bool,
        typer.Option(
            "--memory",
            help="Also print each method's predicted peak memory per device, from the model's "
            "config.json alone (no weights loaded).",
        ),
    ] = False,
    methods: Annotated[
        Optional[str],  # noqa: UP045 (typer reads the annotation)
        typer.Option("--methods", help="With --memory: comma-separated methods to plan."),
    ] = None,
) -> None:
    """Check a config (and its bench variants) without running anything (exit 2 on error)."""
    from forgetless.bench.sweep import plan_runs
    from forgetless.config.bounds import size_warnings
    from forgetless.config.loading import config_source, load_raw_config

    source = config_source(config, preset)
    cfg, raw = load_raw_config(config, set_, preset)
    _check_builtin_names(cfg, source)
    _check_local_inputs(cfg, source)
    planned = plan_runs(raw.data, cfg.bench.variants if cfg.bench else [], 1, 1, Path("."))
    checks = ([_check_shardable] if fsdp else []) + ([_check_zero] if zero else [])
    for check in checks:
        check(cfg, source)
        for variant, _, run_cfg in planned:
            check(run_cfg, f"{source}, variant {variant.name}")
    for line in size_warnings(cfg, source) + _preset_lines(config, raw):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    shown = [t.display_name for t in cfg.tasks]
    names = ", ".join(shown[:20]) + (f", … ({len(shown)} tasks)" if len(shown) > 20 else "")
    extra = f"; {len(planned)} bench variants ok" if planned else ""
    console.print(
        f"ok: {source} — method {cfg.method.name}, {cfg.finetune.mode} fine-tuning, "
        f"tasks: {names}{extra}",
        soft_wrap=True,
    )
    if memory:
        _print_memory_plan(cfg, methods)


def _print_memory_plan(cfg: Any, methods: str | None) -> None:
    """The predicted peak per device of each method, without and with checkpointing."""
    from forgetless.models.memory_plan import plans, unit_for

    shape, rows = plans(cfg, methods)
    unit, scale = unit_for(rows)
    table = Table(title=f"predicted peak per device, {unit} ({shape.params:,} parameters)")
    for head in ("method", "ckpt", "weights", "grads", "AdamW", "own", "activ.", "peak"):
        table.add_column(head, justify="left" if head in ("method", "ckpt") else "right")
    for plain, checkpointed in rows:
        for plan, ckpt in ((plain, "off"), (checkpointed, "on")):
            parts = (plan.weights, plan.gradients, plan.optimizer, plan.method_state)
            cells = [f"{v / scale:.2f}" for v in (*parts, plan.activations, plan.peak)]
            table.add_row(plan.method, ckpt, *cells)
    console.print(table)
    console.print(
        "own: the method's state (reference copies, Fisher, buffers); activ.: one micro-batch "
        "at train.batch_size x max_length, every position labelled (an upper bound: most "
        "methods compute the logits over the completion alone); ckpt: gradient checkpointing",
        soft_wrap=True,
    )
    for plain, _ in rows:
        for note in plain.notes:
            console.print(f"{plain.method}: {note}", markup=False, soft_wrap=True)


def _preset_lines(config: Path | None, raw: RawConfig) -> list[str]:
    """What a preset under the config set: one line per key the file left to it."""
    if config is None or raw.preset is None:
        return []
    if not raw.supplied:
        return [f"preset {raw.preset}: every key it sets is set by {config} too"]
    lines = [f"preset {raw.preset} set {len(raw.supplied)} keys that {config} leaves out:"]
    return lines + [f"  {key}: {_shown(_value_at(raw.data, key))}" for key in raw.supplied]


def _value_at(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data[part]
    return data


def _shown(value: Any) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value)


def _check_shardable(cfg: Any, source: str) -> None:
    from forgetless.core import registry
    from forgetless.errors import ConfigError

    method = registry.lookup(cfg.method.name)
    broken = registry.sharding_rule_broken(
        method, cfg.finetune.mode, cfg.method, cfg.finetune.lora.regime
    )
    if broken:
        raise ConfigError(f"{source}: {broken}")


def _check_zero(cfg: Any, source: str) -> None:
    from forgetless.core import registry
    from forgetless.errors import ConfigError

    method = registry.lookup(cfg.method.name)
    broken = registry.zero_rule_broken(method, cfg.budget is not None, cfg.train.checkpoint_every)
    if broken:
        raise ConfigError(f"{source}: {broken}")


def _check_builtin_names(cfg: Any, source: str) -> None:
    """Unknown built-in task names, found offline (``run`` finds them when it builds the tasks)."""
    from forgetless.config.schema import task_places
    from forgetless.errors import ConfigError
    from forgetless.tasks.builtin import known_task_names, unknown_task

    for section, index, task in task_places(cfg):
        if task.builtin is not None and task.builtin not in known_task_names():
            raise ConfigError(f"{source}: {section}.{index}: {unknown_task(task.builtin)}")


def _check_local_inputs(cfg: Any, source: str) -> None:
    """The local data and model folder read as ``run`` reads them (hub ids are left to it)."""
    from forgetless.training.inputs import check_local_inputs

    try:
        check_local_inputs(cfg)
    except ForgetlessError as err:
        raise type(err)(f"{source}: {err}") from None


@app.command()
def methods() -> None:
    """List the forgetting-control methods: what each hooks into, its paper, and what it does."""
    import warnings

    from forgetless.contract import registered_methods

    with warnings.catch_warnings():  # listing is not using: the experimental corner is marked
        warnings.simplefilter("ignore")
        found = registered_methods()
    table = Table("method", "capabilities", "paper", "what it does")
    for name, cls in sorted(found.items()):
        caps = ", ".join(sorted(c.value for c in cls.capabilities)) or "-"
        paper = getattr(cls, "paper", None)
        table.add_row(
            _method_label(name, cls),
            caps,
            escape(str(paper)) if paper else "-",
            _method_summary(cls),
        )
    console.print(table)


def _method_label(name: str, cls: type) -> str:
    experimental = cls.__module__.startswith("forgetless.experimental")
    return f"{name} (experimental)" if experimental else name


def _method_summary(cls: Any) -> str:
    """The config's one-line description of the method, else the docstring's first sentence."""
    field = cls.config_cls.model_fields.get("name")
    if field is not None and field.description:
        return " ".join(field.description.split()).rstrip(".")
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


@app.command()
def tasks() -> None:
    """List the built-in task suite."""
    from forgetless.tasks.builtin import (
        BUILTIN_TASKS,
        build_builtin_task,
        known_task_names,
        latent_skill_names,
    )
    from forgetless.tasks.general import GENERAL_PROBES

    latent = set(latent_skill_names())
    table = Table("task", "role", "example", "description")
    for name in known_task_names():
        task = build_builtin_task(name, n_train=1, n_eval=1, seed=0)
        example, spec = task.eval[0], BUILTIN_TASKS.get(name)
        role = (
            "real track: general probe"
            if name in GENERAL_PROBES
            else "real track: instruct sequence"
            if spec is None
            else "latent (in the base, never probed)"
            if name in latent
            else "base capability (probe)"
            if spec.base_capability
            else "sequence"
        )
        shown = (
            f"{example.prompt} -> {example.completion}"
            if spec is None
            else f"{example.prompt}{example.completion}"
        )
        table.add_row(name, role, escape(shown), escape(task.description))
    console.print(table)


@app.command()
def pretrain(
    config: ConfigArg = None,
    set_: SetOpt = None,
    out: Annotated[Optional[Path], typer.Option(help="Folder (default: the cache).")] = None,  # noqa: UP045
    quiet: QuietOpt = False,
    preset: PresetOpt = None,
) -> None:
    """Build and pretrain the tiny base model on the base capabilities, under a seed."""
    from forgetless.config.loading import load_config
    from forgetless.training.pretrain import cached_base_dir, pretrain_base

    cfg = load_config(config, set_, preset)
    folder = out or cached_base_dir(cfg.model)
    pretrain_base(cfg.model, folder, console, progress=not quiet)
    console.print(f"saved: {folder}")


def split_variants(spec: str) -> list[str]:
    """Split ``a,b@x=1,y=2,c`` into variants: a bare ``key=value`` belongs to the one before it."""
    items: list[str] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" in part and "@" not in part and items:
            items[-1] += "," + part
        else:
            items.append(part)
    return items


@app.command()
def bench(
    config: ConfigArg = None,
    methods: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            help="Variants: the config's by name, or methods (seq_ft,kl_sft@beta=0.5); "
            "'all' = every method."
        ),
    ] = None,
    seeds: Annotated[Optional[int], typer.Option(min=1, help="Seeds per variant.")] = None,  # noqa: UP045
    first_seed: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="First seed (default 0): tune on seeds apart from the measuring ones."),
    ] = None,
    orders: Annotated[Optional[int], typer.Option(min=1, help="Task orders per seed.")] = None,  # noqa: UP045
    out: Annotated[Optional[Path], typer.Option(help="Output folder (default runs/bench).")] = None,  # noqa: UP045
    set_: SetOpt = None,
    quiet: QuietOpt = False,
    preset: PresetOpt = None,
    campaign: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            help="Keep each finished run's raw results here (commit them) and skip the runs "
            "kept under the same config: a bench that resumes on a fresh clone."
        ),
    ] = None,
    jobs: Annotated[
        int, typer.Option(min=1, help="Runs in parallel, each in its own worker process.")
    ] = 1,
    threads: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(min=1, help="CPU threads per run (default: the cores shared out by --jobs)."),
    ] = None,
    cluster: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            help="Send each run to a cluster job: slurm (through submitit; job settings in the "
            "config's bench.cluster), or local (the same jobs as processes here)."
        ),
    ] = None,
) -> None:
    """Run methods side by side on one sequence, seeds and budget; write bench.json + report."""
    from forgetless.bench.jobs import oversubscribed
    from forgetless.bench.sweep import run_bench
    from forgetless.bench.variants import BenchSection, parse_variant, select_variants
    from forgetless.config.loading import load_config_data
    from forgetless.config.presets import DEMO_BENCH_METHODS
    from forgetless.contract import registered_methods
    from forgetless.core import registry
    from forgetless.errors import ConfigError
    from forgetless.report.render import write_report
    from forgetless.report.table import bench_screen_table

    cfg, data = load_config_data(config, set_, preset)
    section = cfg.bench or BenchSection()
    if methods == "all":
        variants = [parse_variant(name) for name in sorted(registered_methods())]
    elif methods is not None:
        variants = select_variants(split_variants(methods), section.variants)
        if not variants:
            raise ConfigError("--methods: names no variant; e.g. --methods seq_ft,ewc")
    else:
        known = registry.known_names()  # without importing every method (nor the experimental)
        defaults = [m for m in DEMO_BENCH_METHODS if m in known]
        variants = section.variants or [parse_variant(m) for m in defaults]
    out_dir = out or Path("runs") / "bench"
    warning = None if cluster is not None else oversubscribed(jobs, threads)
    if warning:
        err_console.print(warning, markup=False, highlight=False, soft_wrap=True)
    result = run_bench(
        data,
        variants,
        section.seeds if seeds is None else seeds,
        section.orders if orders is None else orders,
        out_dir,
        console,
        progress=not quiet,
        first_seed=section.first_seed if first_seed is None else first_seed,
        campaign=campaign,
        jobs=jobs,
        threads=threads,
        cluster=None if cluster is None else (cluster, section.cluster),
    )
    console.print(bench_screen_table(result["rows"]))
    md_path, html_path = write_report(out_dir)
    console.print(f"all columns: {md_path}  {html_path}\nbench: {out_dir / 'bench.json'}")


@app.command()
def report(folder: Annotated[Path, typer.Argument(help="A run or bench output folder.")]) -> None:
    """Write report.md and a self-contained report.html (with plots) for a run or a bench."""
    from forgetless.report.render import write_report

    md_path, html_path = write_report(folder)
    console.print(f"wrote {md_path} and {html_path}")


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A finished run folder.")],
    out: Annotated[
        Path,
        typer.Argument(help="Model folder: new, empty, or an earlier export (replaced whole)."),
    ],
    task: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="The model after this task (1-based; default: the last finished)."),
    ] = None,
) -> None:
    """Save a run's model as a plain transformers folder, LoRA folded in.

    Safetensors weights, tokenizer and chat template, for `diagnose circuits`, transformers or
    mergekit."""
    from forgetless.training.export import EXPORT_RECORD, export_model

    earlier = (out / EXPORT_RECORD).is_file()
    record = export_model(run_dir, out, task)
    folded = " (LoRA folded in)" if record["lora_folded_in"] else ""
    replaced = " (the export that was there is replaced)" if earlier else ""
    console.print(
        f"model after task {record['after_task']} ({record['task']}){folded}: {out}{replaced}"
    )


def _is_click_error(err: BaseException) -> bool:
    """typer vendors click, so its exceptions are matched by class name, not by import."""
    return any(c.__name__ == "ClickException" for c in type(err).__mro__)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _fail(message: str, code: int) -> int:
    err_console.print(_one_line(message), markup=False, highlight=False, soft_wrap=True)
    return code


def run_cli(args: list[str]) -> int:
    """Run the app on ``args``; every expected failure is one line on stderr and an exit code:
    2 for bad input, 1 for a fault of the machine (disk, permissions), 130 for an interrupt.
    ``--debug`` anywhere in ``args`` lets the traceback through instead."""
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    try:
        code = app(args=args, standalone_mode=False)
    except ForgetlessError as err:
        if debug:
            raise
        return _fail(f"error: {err}", err.exit_code)
    except KeyboardInterrupt:
        return _interrupted()
    except typer.Exit as exit_:
        return int(exit_.exit_code)
    except OSError as err:
        if debug:
            raise
        where = f"{err.filename}: " if err.filename else ""
        return _fail(f"error: {where}{err.strerror or err}", 1)
    except Exception as err:
        if _is_click_error(err):
            hint = " (see --help)" if getattr(err, "exit_code", 1) == 2 else ""
            return _fail(f"error: {err.format_message()}{hint}", int(err.exit_code))  # type: ignore[attr-defined]
        if debug:
            raise
        if _disk_full(err):  # a writer no ``disk_writes`` covers: the place is unknown
            return _fail(f"error: {_first_line(err)}; free some space and re-run", 1)
        return _fail(
            f"internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback)",
            1,
        )
    if code == 130:  # typer turns a Ctrl-C into this return value under standalone_mode=False
        return _interrupted()
    return code if isinstance(code, int) else 0


def _disk_full(err: BaseException) -> bool:
    from forgetless.core.storage import is_disk_full

    return is_disk_full(err)


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _say(line: str) -> None:
    """One line on stderr, unbuffered: safe inside a signal handler, even mid-print."""
    import os

    os.write(2, (line + "\n").encode())


class _Interrupts:
    """Ctrl-C under ``main``: the first raises KeyboardInterrupt (the command cleans up and ends
    with ``interrupted``); a second is announced, not raised, so that the clean-up it would break
    finishes; a third stops at once. Once the command is over (``done``), one stops at once: a
    KeyboardInterrupt in the interpreter's shutdown would print a traceback."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.done = False
        self.reported = False  # "interrupted" is printed
        self.holding = False  # it is being printed: a Ctrl-C waits for it (``pending``)
        self.pending = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.holding:
            self.pending = True
            return
        if self.done or self.count > 2:
            self.stop()
        if self.count == 1:
            raise KeyboardInterrupt
        _say("interrupted again: finishing clean-up; Ctrl-C once more to stop at once")

    def stop(self) -> None:
        import contextlib
        import os

        if not self.reported:
            _say("interrupted")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, RuntimeError, ValueError):  # reentrant or closed
                stream.flush()
        os._exit(130)


_INTERRUPTS = _Interrupts()
"""The SIGINT handler that ``main`` installs (``run_cli`` alone leaves signals as they are)."""


def _interrupted() -> int:
    """Print the one line ``interrupted``; a Ctrl-C from then on ends the process at once (one
    that comes while the line is printed waits for it, so that it is printed once, whole)."""
    state = _INTERRUPTS
    state.holding = True
    try:
        code = _fail("interrupted", 130)
        state.done = state.reported = True
    finally:
        state.holding = False
    if state.pending:
        state.stop()
    return code


def one_line_warnings() -> None:
    """forgetless's own warnings print as one line, as its errors do (Python's format adds the
    file that raised it and its source line); other packages' keep Python's format."""
    import warnings

    plain = warnings.formatwarning

    def formatted(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        line: str | None = None,
    ) -> str:
        if category.__module__.startswith("forgetless"):
            return f"warning: {message}\n"
        return plain(message, category, filename, lineno, line)

    warnings.formatwarning = formatted


def main() -> None:
    import atexit
    import signal
    import threading

    one_line_warnings()
    _INTERRUPTS.reset()
    # an ignored SIGINT (a background job of a script) stays ignored, as Python leaves it
    default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if default and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _INTERRUPTS)
        # the last exit step (atexit runs in reverse): for the rest of its shutdown Python puts
        # back the default SIGINT, which would end the process by the signal, not with its code
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
    try:
        code = run_cli(sys.argv[1:])
        _INTERRUPTS.done = True
    except KeyboardInterrupt:  # raised while run_cli reported another failure, or returned
        code = _interrupted()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
