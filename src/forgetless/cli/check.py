"""``forgetless check MODEL_OR_ADAPTER --base BASE --probes ... --max-loss X``: a forgetting gate.

Exit 0 when the model's loss of the base's above-chance skill on the probes is at most X at the
declared confidence, 1 when it may be more, 2 on bad input (one line naming the place). The
statistic is ``forgetless.eval.gate``'s: a paired bootstrap over the probe items.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

if TYPE_CHECKING:
    from forgetless.config.schema import ModelConfig
    from forgetless.eval.gate import GateVerdict
    from forgetless.tasks.base import Task

console = Console()

PROSE_PARAGRAPHS = 8
"""The prose paragraphs KL is measured on by default: those a run measures it on, which
``replay``'s general prose never trains on (``forgetless.methods.replay.PROSE_HELD_OUT``)."""


def check(
    model: Annotated[
        str,
        typer.Argument(
            metavar="MODEL_OR_ADAPTER",
            help="A model folder (or hub id), or a PEFT adapter folder loaded onto --base.",
        ),
    ],
    base: Annotated[str, typer.Option(help="The base model: a folder or a hub id.")],
    probes: Annotated[
        str,
        typer.Option(
            help="Comma-separated probes: built-in task names (see `forgetless tasks`) or JSONL "
            "files of prompt/completion records (every line an item)."
        ),
    ],
    max_loss: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="The most of the base's above-chance skill the model may lose (0.05 = 5%).",
        ),
    ],
    confidence: Annotated[
        float,
        typer.Option(min=0.5, max=0.9999, help="Confidence of the one-sided bound on the loss."),
    ] = 0.95,
    repeats: Annotated[
        int, typer.Option(min=10, help="Bootstrap resamples of the probe items.")
    ] = 2000,
    n_eval: Annotated[int, typer.Option(min=1, help="Items per probe, at most.")] = 200,
    prose_paragraphs: Annotated[
        int,
        typer.Option(min=0, help="Held-out prose paragraphs for KL(base || model) (0: none)."),
    ] = PROSE_PARAGRAPHS,
    batch_size: Annotated[int, typer.Option(min=1, help="Prompts per scoring batch.")] = 32,
    dtype: Annotated[
        str, typer.Option(help="Weights dtype: float32, bfloat16 or float16.")
    ] = "float32",
    seed: Annotated[
        int, typer.Option(min=0, help="Seed of the items drawn and the bootstrap.")
    ] = 0,
) -> None:
    """Gate a fine-tuned model on how much of its base's skill it lost.

    Exit 0 when the one-sided bound on the loss (a paired bootstrap over the probe items) is at
    most --max-loss, 1 when it is not, 2 on bad input."""
    from forgetless.config.schema import EvalConfig, ModelConfig
    from forgetless.errors import ConfigError, DataError
    from forgetless.eval.gate import check_model

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype: {dtype!r} is none of float32, bfloat16, float16")
    model_cfg = ModelConfig(dtype=dtype)  # type: ignore[arg-type]
    tasks = probe_tasks(probes, n_eval, seed)
    candidate, reference, tokenizer = load_pair(model, base, model_cfg)
    settings = EvalConfig(
        batch_size=batch_size,
        kl_drift=False,
        loglik_examples=0,
        prose=prose_paragraphs > 0,
        prose_paragraphs=max(prose_paragraphs, 1),
        prose_kl_paragraphs=max(prose_paragraphs, 1),
    )
    try:
        verdict = check_model(
            candidate, reference, tokenizer, tasks, max_loss, confidence, repeats, seed, settings
        )
    except DataError as err:  # no probe where the base is above chance
        raise DataError(f"--probes: {err}") from None
    for line in render(verdict, model, base):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if not verdict.passed:
        raise typer.Exit(1)


def probe_tasks(spec: str, n_eval: int, seed: int) -> list[Task]:
    """The probes ``spec`` names: built-in tasks, or JSONL files whose every line is an item."""
    from pydantic import ValidationError

    from forgetless.config.evaluation import LMEVAL_PREFIX
    from forgetless.config.schema import EvalConfig, JsonlSource, TaskConfig
    from forgetless.errors import ConfigError, DataError
    from forgetless.tasks.loaders import JSONL_HINT, build_task

    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ConfigError("--probes: name at least one probe (a built-in task or a JSONL file)")
    if len(set(names)) != len(names):
        raise ConfigError(f"--probes: a probe is named twice in {spec!r}")
    tasks = []
    for name in names:
        if name.startswith(LMEVAL_PREFIX):
            raise ConfigError(
                f"--probes: {name}: lm-eval probes give no per-item verdicts to pair; "
                "use built-in or JSONL probes"
            )
        path = Path(name).expanduser()
        is_file = name.endswith(".jsonl") or path.is_file()
        try:
            cfg = (
                TaskConfig(jsonl=JsonlSource(train=path, eval=path))
                if is_file
                else TaskConfig(builtin=name)
            )
            tasks.append(build_task(cfg, EvalConfig(n_eval=n_eval, n_train=1), seed))
        except ValidationError as err:
            first = err.errors()[0]["msg"]
            raise ConfigError(f"--probes: {name}: {first}") from None
        except DataError as err:  # check takes no column map: the keys must be the usual ones
            said = str(err).replace(JSONL_HINT, " (check reads the keys prompt and completion)")
            raise DataError(f"--probes: {said}") from None
    return tasks


def load_pair(model: str, base: str, cfg: ModelConfig) -> tuple[Any, Any, Any]:
    """The model to check (an adapter folder loaded onto the base, or a model as it is), the
    base, and the base's tokenizer (a model's own tokenizer must spell text as it does)."""
    from forgetless.models.loading import load_model, load_tokenizer

    base_source = _source(base, "--base")
    with _place("--base"):
        reference, tokenizer = load_model(base_source, cfg), load_tokenizer(base_source, cfg)
    folder = Path(model).expanduser()
    if (folder / "adapter_config.json").is_file():
        with _place("--base"):
            onto = load_model(base_source, cfg)
        return _with_adapter(onto, folder, base), reference, tokenizer
    _refuse_a_folder_of_models(folder)
    source = _source(model, "MODEL_OR_ADAPTER")
    with _place("MODEL_OR_ADAPTER"):
        candidate = load_model(source, cfg)
        if _has_tokenizer(source):
            _same_tokenizer(load_tokenizer(source, cfg), tokenizer)
    return candidate, reference, tokenizer


def _refuse_a_folder_of_models(folder: Path) -> None:
    """A run folder, or a folder of named adapters, holds models but is none: say which to use."""
    from forgetless.errors import ModelLoadError
    from forgetless.training.export import run_folder_advice

    if not folder.is_dir() or (folder / "config.json").is_file():
        return
    advice = run_folder_advice(folder)
    if advice:
        raise ModelLoadError(f"MODEL_OR_ADAPTER: {advice}")
    inner = sorted(str(p.parent) for p in folder.glob("*/adapter_config.json"))
    if inner:
        raise ModelLoadError(
            f"MODEL_OR_ADAPTER: {folder} holds adapters by name; give one: {', '.join(inner)}"
        )


def _source(name: str, place: str) -> str:
    from forgetless.errors import ModelLoadError
    from forgetless.models.loading import resolve_source

    if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().exists():
        raise ModelLoadError(f"{place}: no such folder: {Path(name).expanduser()}")
    with _place(place):
        return resolve_source(name)


@contextmanager
def _place(place: str) -> Iterator[None]:
    """Re-label the loaders' errors (written for the config's ``model.name_or_path``)."""
    from forgetless.errors import ModelLoadError

    try:
        yield
    except ModelLoadError as err:
        raise ModelLoadError(str(err).replace("model.name_or_path", place, 1)) from None


def _with_adapter(model: Any, folder: Path, base: str) -> Any:
    """A PEFT adapter folded into (a fresh copy of) the base, to be scored like any model."""
    from peft import PeftModel

    from forgetless.errors import ModelLoadError
    from forgetless.models.finetuner import peft_quiet

    try:
        with peft_quiet():
            return PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ModelLoadError(
            f"MODEL_OR_ADAPTER: the adapter {folder} does not load onto {base}: {first}"
        ) from None


def _has_tokenizer(source: str) -> bool:
    from forgetless.models.loading import VOCABULARY_FILES

    path = Path(source)
    return path.is_dir() and any(next(path.glob(p), None) for p in VOCABULARY_FILES)


def _same_tokenizer(own: Any, base: Any) -> None:
    from forgetless.errors import ModelLoadError

    if own.get_vocab() != base.get_vocab():
        raise ModelLoadError(
            "MODEL_OR_ADAPTER: its tokenizer differs from the base's, so the two would not read "
            "the probes alike"
        )


def render(verdict: GateVerdict, model: str, base: str) -> list[str]:
    """The gate's report, one line per probe, then the prose, the noise floor and the verdict."""
    pct = f"{verdict.confidence:.0%}"
    lines = [
        f"forgetless check: {model} against the base {base}",
        f"{'probe':<16}{'items':>6}{'chance':>8}{'base':>7}{'model':>7}{'retention':>11}"
        f"  {pct} bounds",
    ]
    for p in verdict.probes:
        kept = "-" if p.retention is None else f"{p.retention:.3f}"
        bounds = "base at chance: left out" if p.low is None else f"[{p.low:.3f}, {p.high:.3f}]"
        lines.append(
            f"{p.name:<16}{p.items:>6}{p.chance:>8.3f}{p.base:>7.3f}{p.model:>7.3f}{kept:>11}"
            f"  {bounds}"
        )
    lines.append(
        f"{'all':<16}{sum(p.items for p in verdict.probes):>6}{'':>22}{verdict.retention:>11.3f}"
        f"  [{verdict.low:.3f}, {verdict.high:.3f}]"
    )
    lines.append(
        f"retention: unclipped above-chance ratio to the base, mean over probes; bounds: "
        f"one-sided {pct} of {verdict.repeats} paired bootstrap resamples over the items"
    )
    if verdict.prose:
        kl = max(verdict.prose["kl_base_to_model"], 0.0)  # -0.0000 from rounding reads oddly
        lines.append(
            f"prose: KL(base || model) {kl:.4f} per token, perplexity "
            f"{verdict.prose['perplexity']:.3f}, {int(verdict.prose['paragraphs'])} held-out "
            "paragraphs"
        )
    lines.append(
        f"noise floor: {verdict.noise_floor:.3f} (the loss between two draws of the base's own "
        f"items, at {pct})"
    )
    word = "PASS" if verdict.passed else "FAIL"
    sign = "<=" if verdict.passed else ">"
    lines.append(
        f"{word}: loss {verdict.loss:.3f}, at most {verdict.loss_bound:.3f} at {pct} confidence "
        f"{sign} max-loss {verdict.max_loss:.3f}"
    )
    return lines
