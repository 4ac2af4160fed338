"""The run configuration: pydantic models that reject unknown keys and bad values early."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    SerializeAsAny,
    Tag,
    field_validator,
    model_validator,
)

from forgetless.config.bench import BenchSection
from forgetless.config.budget import BudgetConfig
from forgetless.config.evaluation import (
    LmEvalProbe,
    ScorerConfig,
    is_lm_eval_probe,
    scorer_shorthand,
)
from forgetless.config.quantization import QuantizationConfig, quantized_rule_broken
from forgetless.core import registry
from forgetless.core.fields import Count, NonNegative, Positive
from forgetless.strict import MethodConfig, StrictModel

TASK_NAME = re.compile(r"\w[\w .+=@-]{0,99}")
"""A task's name names its checkpoint folder: no separators, no leading dot, no markup."""


class Strict(StrictModel):
    """A config section: unknown keys, non-finite numbers and booleans for numbers are refused."""


class TinyModelConfig(Strict):
    """A small Llama/Qwen2 model built from a config, for CPU runs and tests."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    """Architecture class to build."""
    hidden_size: int = Field(128, ge=8)
    """Hidden width."""
    num_layers: Count = 4
    """Number of decoder layers."""
    num_heads: Count = 4
    """Attention heads."""
    num_kv_heads: Count = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = Field(512, ge=8)
    """MLP width."""
    max_position: int = Field(128, ge=16)
    """Longest sequence in tokens."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must divide hidden_size and num_kv_heads divide num_heads")
        return self


BASE_MIXTURE = (
    *("copy", "upper", "facts", "add"),
    *(f"ask-{t}" for t in ("reverse", "sort", "count", "cipher", "bracket", "double", "addmc")),
    "ask-calc",
)
"""The tiny base's pretraining mixture: the four probed capabilities, then the latent skills
(``forgetless.tasks.builtin.LATENT_SKILLS``, checked equal by a test)."""


class PretrainConfig(Strict):
    """How the built-in base model is pretrained on the base-capability tasks."""

    tasks: list[str] = Field(default_factory=lambda: list(BASE_MIXTURE))
    """Built-in tasks in the pretraining mixture: the probed base capabilities and the latent ask-*
    skills."""
    steps: Count = 12000
    """Optimizer steps."""
    batch_size: Count = 32
    """Examples per step."""
    lr: Positive = 3e-3
    """Peak learning rate (cosine schedule)."""
    n_train: Count = 4000
    """Training examples per task."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seed for weights and data."""


class ModelConfig(Strict):
    name_or_path: str | None = None
    """Hub id or local directory; null builds and pretrains the built-in tiny base."""
    revision: str | None = None
    """Hub revision (branch, tag or commit)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype."""
    trust_remote_code: bool = False
    """Run code shipped with the model (risky)."""
    attn_implementation: str | None = "sdpa"
    """Attention kernel: sdpa (PyTorch's fused scaled-dot-product attention; a model without it
    falls back to eager, said at start), eager, flash_attention_2, ...; null: transformers' own
    choice."""
    quantization: QuantizationConfig | None = None
    """Load the base in 4 bits under LoRA (QLoRA; needs the qlora extra): {bits: 4}. Null: weights
    in model.dtype."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)  # type: ignore[arg-type]
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)  # type: ignore[arg-type]


class LoraConfig(Strict):
    r: Count = 8
    """LoRA rank."""
    alpha: int = Field(16, gt=0)
    """LoRA scale numerator (scale = alpha / r)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA path."""
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    """Module names that get adapters."""
    layers: list[int] | None = None
    """Decoder layer indices that get adapters (PEFT layers_to_transform); null: all. Adapters on
    the top layers only stop the backward pass there."""
    regime: Literal["carry", "merge", "per_task"] = "carry"
    """carry: one adapter for the whole sequence (SeqLoRA); merge: a new adapter per task merged at
    its end; per_task: a new adapter per task, past ones frozen beside it."""


def finetune_shorthand(value: Any) -> Any:
    """``finetune: lora`` (or ``full``) for ``{mode: lora}``, as ``ContinualTrainer`` takes it."""
    return {"mode": value} if isinstance(value, str) else value


class FinetuneConfig(Strict):
    mode: Literal["full", "lora"] = "full"
    """Full fine-tuning or LoRA (PEFT)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)  # type: ignore[arg-type]


SHORT_MAX_LENGTH = 64
"""The least an unset ``train.max_length`` becomes (the model's positions allowing), and what a
tool outside a run takes for it: the default before it was chosen from the data, so short data
trains as it always did (a longer limit than the data needs costs nothing: batches are padded to
their own longest example)."""


class TrainConfig(Strict):
    """Per-task training budget; a task's ``train`` block overrides any of these."""

    steps: Count | None = 200
    """Optimizer steps per task (or use epochs)."""
    epochs: Positive | None = None
    """Epochs per task; overrides steps."""
    batch_size: Count = 32
    """Examples per micro-batch."""
    grad_accum: Count = 1
    """Micro-batches per optimizer step."""
    lr: Positive = 1e-3
    """Peak learning rate (AdamW)."""
    weight_decay: NonNegative = 0.0
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """LR schedule."""
    max_grad_norm: Positive | None = 1.0
    """Gradient clipping; null disables."""
    max_length: int | None = Field(None, ge=8)
    """Longest training example in tokens: a longer one keeps its first max_length tokens (the
    completion's end is cut, counted and warned about); one whose prompt alone fills it is an
    error. More than the model's positions is refused. Null: the longest example of the run's
    tasks and probes, at least 64 and at most the model's positions (printed at start)."""
    autocast: Literal["off", "bf16", "fp16"] = "off"
    """bf16 or fp16: training's forward passes under bfloat16 or float16 autocast (weights and
    optimizer state stay float32; fp16 scales the loss with a gradient scaler and skips the steps
    whose gradients overflow, counted in results.json); evaluation stays float32."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (transformers' gradient checkpointing, non-reentrant): less memory for about a third more
    compute per step; the gradients are the same."""
    optimizer_restarts: int = Field(0, ge=0)
    """Clear AdamW's state this many times within each task, at evenly spaced steps: a control
    matched to a method that restarts its optimizer (anchored starts one per anchor)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf loss or gradient: stop the run (the event goes into results.json), or skip that
    step's update and count it."""
    checkpoint_every: Count | None = None
    """Write a step checkpoint (weights, optimizer, scheduler, RNG, data order, method state) every
    N optimizer steps and when a task's training ends, so a re-run resumes inside the task; null:
    resume only after finished tasks."""
    padding_free: bool = False
    """Pack each micro-batch's examples into one row, positions restarting at 0 per example, so no
    pad token is computed; the loss is the padded batch's. A method that reads the batch's rows
    is refused; an attention that does not keep packed sequences apart batches examples of
    similar length instead."""

    @property
    def resolved_max_length(self) -> int:
        """``max_length``; unset, the former default (a tool outside a run, which has no data
        to measure: a run sets ``max_length`` from its data first)."""
        return self.max_length if self.max_length is not None else SHORT_MAX_LENGTH


class TrainOverrides(Strict):
    steps: Count | None = None
    epochs: Positive | None = None
    batch_size: Count | None = None
    lr: Positive | None = None


DEFAULT_EVAL_FRACTION = 0.1
"""A task's evaluation share of its one file (or split) when it names no other; a probe's file
is its evaluation set, whole, unless a split is asked for."""


class Columns(Strict):
    """Which key of a JSONL record holds each field (e.g. ``{prompt: question}``)."""

    prompt: str = "prompt"
    """The prompt's key."""
    completion: str = "completion"
    """The answer's key."""
    messages: str = "messages"
    """Chat turns' key (a list of {role, content})."""
    choices: str = "choices"
    """Multiple-choice options' key (a list of str)."""
    label: str = "label"
    """The right choice's index key."""


class JsonlSource(Strict):
    train: Path
    """JSONL with prompt/completion or messages per line."""
    eval: Path | None = None
    """Eval JSONL; default: a task splits eval_fraction off the train file, a probe is evaluated on
    the whole file."""
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    """Eval share split off the train file when eval is not given; null: 0.1 for a task, none for a
    probe (the whole file is evaluated)."""
    columns: Columns = Field(
        default_factory=Columns,  # type: ignore[arg-type]
        description="Keys of the records' fields, e.g. {prompt: question, completion: answer}.",
    )


class HFSource(Strict):
    path: str
    """datasets.load_dataset path, or a save_to_disk directory."""
    name: str | None = None
    """Dataset configuration name."""
    data_files: str | list[str] | dict[str, str] | None = None
    """Local files."""
    train_split: str = Field("train")
    eval_split: str | None = None
    """Default: a task splits eval_fraction off the train split, a probe is evaluated on the whole
    train split."""
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    """Eval share split off the train split when eval_split is not given; null: 0.1 for a task, none
    for a probe."""
    prompt_column: str = Field("prompt")
    completion_column: str = Field("completion")
    messages_column: str | None = None
    """Use chat messages instead of columns."""
    choices_column: str | None = None
    """Multiple-choice options, a list of str (default column: choices)."""
    label_column: str | None = None
    """Index of the right choice (default column: label)."""


class TaskConfig(Strict):
    """One task: a built-in name, a JSONL source or a Hugging Face dataset."""

    builtin: str | None = None
    """A built-in task (see `forgetless tasks`)."""
    name: str | None = None
    """Display name; default: the source's name."""
    jsonl: JsonlSource | None = None
    hf: HFSource | None = None
    n_train: Count | None = None
    """Cap on training examples."""
    n_eval: Count | None = None
    """Cap on eval examples."""
    max_new_tokens: Count | None = None
    """Generation budget for scoring, in tokens; null: the built-in task's own, or 64 for JSONL and
    Hugging Face tasks."""
    scorer: Annotated[ScorerConfig | None, BeforeValidator(scorer_shorthand)] = None
    """How the task is scored: exact_match (default), contains, startswith, regex, numeric,
    multiple_choice; a kind name or {kind: ..., options}. Null: the task's own."""
    train: TrainOverrides = Field(default_factory=TrainOverrides)  # type: ignore[arg-type]

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"builtin": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_source(self) -> TaskConfig:
        sources = [s for s in (self.builtin, self.jsonl, self.hf) if s is not None]
        if len(sources) != 1:
            raise ValueError("a task needs exactly one of builtin, jsonl, hf")
        if not TASK_NAME.fullmatch(self.display_name):
            raise ValueError(
                f"task name {self.display_name!r} is not usable as a folder name: use letters, "
                "digits and _ . + = @ - or spaces, starting with a letter or digit, at most 100 "
                "characters (set name: to choose one)"
            )
        return self

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        if self.builtin:
            return self.builtin
        if self.jsonl:
            return self.jsonl.train.stem
        assert self.hf is not None
        return Path(self.hf.path).name


class EvalConfig(Strict):
    n_eval: Count = 100
    """Eval examples per task unless the task says."""
    n_train: Count = 2000
    """Training examples per task: a built-in task is built to this size, and a JSONL or
    Hugging Face task without its own n_train keeps this many of its rows (the run says so)."""
    batch_size: Count = 128
    """Prompts per generation batch."""
    kl_drift: bool = True
    """Measure output-space KL drift on the probes."""
    kl_examples: Count = 32
    """Probe examples per probe for KL drift."""
    loglik_examples: int = Field(64, ge=0)
    """Eval examples per task and probe for the gold completion's mean log-likelihood, a continuous
    signal beside accuracy (0: off)."""
    between: Count | None = None
    """Eval examples per task and probe in the rows after every task but the last (the base row and
    the final row use n_eval; the prose there is only its KL paragraphs): small evaluations
    between tasks, the full one at the end. Null: n_eval everywhere."""
    cache_base_row: bool = False
    """Evaluate the base once and cache row 0 for every run on the same model, tasks, probes,
    evaluation settings and seed ($FORGETLESS_CACHE/base-rows)."""
    prose: bool = False
    """Perplexity and token KL(base || model) on the shipped held-out prose (48 paragraphs written
    for forgetless), in every row."""
    prose_paragraphs: Count = 48
    """Prose paragraphs for perplexity."""
    prose_kl_paragraphs: Count = 8
    """Of those, the first ones whose base distributions are kept for KL."""
    prose_max_tokens: int = Field(192, ge=8)
    """Tokens per prose paragraph, at most."""
    forgetting: Literal["any", "learned"] = "any"
    """Forgetting's reference: the best row after any earlier task (Chaudhry et al. 2018) or only
    rows from when the task was learned."""


ProbeConfig = Annotated[
    Union[Annotated[TaskConfig, Tag("task")], Annotated[LmEvalProbe, Tag("lm_eval")]],  # noqa: UP007
    Discriminator(lambda v: "lm_eval" if is_lm_eval_probe(v) else "task"),
]


def probe_names(probes: list[TaskConfig | LmEvalProbe]) -> list[str]:
    """Probe column names in config order (an lm-eval probe gives one per lm-eval task)."""
    return [
        name
        for p in probes
        for name in (p.names if isinstance(p, LmEvalProbe) else [p.display_name])
    ]


def method_config(value: Any) -> MethodConfig:
    """A method entry (a name, a mapping or a config) as its method's own config class, found
    through the registry: only the named method's module is imported."""
    if isinstance(value, MethodConfig):
        return value
    if isinstance(value, str):
        value = {"name": value}
    name = value.get("name") if isinstance(value, dict) else None
    if not isinstance(name, str):
        raise ValueError("needs a name: a method name or {name: ..., options}")
    cls = registry.lookup(name)
    if cls is None:
        raise ValueError(registry.unknown_method(name))
    config: MethodConfig = cls.config_cls.model_validate(value)
    return config


DEVICE = re.compile(r"auto|cpu|cuda|cuda:\d+|mps")


class RunConfig(Strict):
    """A whole continual run: model, fine-tuning mode, task sequence, probes, method."""

    seed: int = Field(0, ge=0, lt=2**32)
    """Seed for data order, initialisation and sampling."""
    device: str = "auto"
    """Where the model runs: auto (a GPU when there is one, as accelerate places each process), cpu,
    cuda, cuda:N or mps; one that is not available is refused at start."""
    model: ModelConfig = Field(default_factory=ModelConfig)  # type: ignore[arg-type]
    finetune: Annotated[FinetuneConfig, BeforeValidator(finetune_shorthand)] = Field(
        default_factory=FinetuneConfig  # type: ignore[arg-type]
    )
    train: TrainConfig = Field(default_factory=TrainConfig)  # type: ignore[arg-type]
    eval: EvalConfig = Field(default_factory=EvalConfig)  # type: ignore[arg-type]
    tasks: list[TaskConfig] = Field(min_length=1)
    """The continual sequence, in order."""
    probes: list[ProbeConfig] = Field(default_factory=list)
    """Retention probes: tasks like the sequence's, or lm-eval tasks ('lmeval:hellaswag' or
    {lm_eval: {tasks: [...], limit: N}})."""
    report_to: Literal["none", "tensorboard", "wandb", "mlflow", "trackio"] = "none"
    """Experiment tracker (through accelerate); none needs no install."""
    method: SerializeAsAny[MethodConfig] = Field(default_factory=lambda: method_config("seq_ft"))
    """Forgetting control: a method name, or {name: ..., its options}."""
    budget: BudgetConfig | None = None
    """A forgetting budget the runner holds by steering the method's strength (docs/budget.md);
    None: the method's strength as configured."""
    bench: BenchSection | None = Field(None, exclude=True)
    """What `forgetless bench` compares on this config (variants, seeds, orders); a run ignores it,
    and it is not part of a run's resolved config."""

    @field_validator("device")
    @classmethod
    def _device_named(cls, value: str) -> str:
        if not DEVICE.fullmatch(value):
            raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, not {value!r}")
        return value

    @field_validator("method", mode="before")
    @classmethod
    def _resolve_method(cls, value: Any) -> MethodConfig:
        return method_config(value)

    @model_validator(mode="after")
    def _method_fits_finetune(self) -> RunConfig:
        method = registry.lookup(self.method.name)
        broken = registry.lora_rule_broken(method, self.finetune.mode, self.finetune.lora.regime)
        if not broken and self.model.quantization is not None:
            broken = quantized_rule_broken(method, self.finetune.mode, self.finetune.lora.regime)
        if not broken and self.train.padding_free:
            broken = registry.padding_rule_broken(method)
        if broken:
            raise ValueError(broken)
        return self

    @model_validator(mode="after")
    def _budget_fits(self) -> RunConfig:
        if self.budget is None:
            return self
        method = registry.lookup(self.method.name)
        if getattr(method, "knob", None) is None:
            raise ValueError(
                f"budget: method {self.method.name!r} has no strength to steer (no knob)"
            )
        if self.budget.controller == "adaptive_kl" and self.method.name != "kl_sft":
            raise ValueError("budget.controller adaptive_kl steers kl_sft's β: method kl_sft")
        if not self.probes:
            raise ValueError("budget: needs probes to measure what is kept")
        if self.train.checkpoint_every is not None:
            raise ValueError("budget: train.checkpoint_every is not supported under a budget yet")
        return self

    @model_validator(mode="after")
    def _fits_tiny_positions(self) -> RunConfig:
        """The built-in tiny base's positions are known before it is built (another model's are
        checked when it is loaded)."""
        positions, wanted = self.model.tiny.max_position, self.train.max_length
        if self.model.name_or_path is None and wanted is not None and wanted > positions:
            raise ValueError(
                f"train.max_length={wanted} is more than the built-in tiny model's {positions} "
                "positions (model.tiny.max_position); lower it or leave it unset"
            )
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> RunConfig:
        names = Counter([t.display_name for t in self.tasks] + probe_names(self.probes))
        dupes = sorted(n for n, k in names.items() if k > 1)
        if dupes:
            raise ValueError(f"task and probe names must be unique; repeated: {', '.join(dupes)}")
        return self


def task_places(cfg: RunConfig) -> list[tuple[str, int, TaskConfig]]:
    """Every task and task probe with its place in the config (``tasks``/``probes``, index)."""
    places = [("tasks", i, t) for i, t in enumerate(cfg.tasks)]
    return places + [
        ("probes", i, p) for i, p in enumerate(cfg.probes) if isinstance(p, TaskConfig)
    ]
