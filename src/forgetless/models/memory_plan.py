"""A run's predicted peak memory per device, from its config and the model's config.json alone.

The model is built on the meta device (accelerate's ``init_empty_weights``): its parameters are
counted, never loaded. The plan holds, per device,

- **weights**: every parameter at ``model.dtype`` (a 4-bit base: 0.5 byte per quantized linear
  weight plus its scales, the rest at the compute dtype); LoRA adapters in float32 (PEFT upcasts
  adapters of a half-precision base);
- **gradients**: one per trainable parameter, at its dtype;
- **optimizer**: AdamW's two moments per trainable parameter, at its dtype (torch keeps them in
  the parameter's dtype, fused into one kernel, so no temporaries);
- **method state**: what the method keeps besides (``METHOD_STATE``; read from each method);
- **activations** of one micro-batch of ``B = train.batch_size`` sequences of ``T = max_length``
  tokens (every position labelled: the most a batch can hold);

and its peak is weights + optimizer + method state + max(activations, gradients)
(``Plan.peak``).

Activations, per token per decoder layer, in elements (``h`` hidden, ``kv`` key/value width,
``i`` MLP width), with ``a`` bytes for what the matmuls save (2 under bf16 autocast or a half
dtype, else 4) and 4 bytes for what the RMSNorms save (they compute in float32)::

    norms      2 x (h fp32 input + h normalised output, and when the
               norm's weight trains, the h it multiplies)          -> 2h·4 + 2h·a [+2h·4]
    attention  rotated q and k, v, the attention output and its
               reshaped copy (SDPA keeps no T x T matrix, and the
               rotary multiply keeps cos/sin, not q and k)         -> (3h + 2kv)·a
    MLP        gate, SiLU(gate), up, SiLU(gate)·up                 -> 4i·a

plus, with eager attention, the softmax probabilities and their dropout copy (``2·heads·T·a``).
With gradient checkpointing a layer keeps only its input (``h·w`` bytes) and one layer's full
activations live again during its recomputation. The logits of the batch cost
``B·T·V·(a + 12)`` bytes at the loss: the model's logits, their float32 shifted copy, the saved
log-softmax and its gradient in float32. The embedding output and the final norm add one layer's
norm share. Memory the framework holds (CUDA context, the allocator's cache, the Python process)
is left out: on a CPU the plan is compared with the resident-set growth of a training step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from torch import nn

from forgetless.config.schema import RunConfig
from forgetless.core import registry
from forgetless.core.dtypes import DTYPES
from forgetless.errors import ConfigError, ModelLoadError

ADAPTER_BYTES = 4
"""LoRA adapters are float32 (PEFT's ``autocast_adapter_dtype`` upcasts them on a half base)."""
NF4_BYTES = 4.127 / 8
"""Bytes per 4-bit weight with its block scales (QLoRA: 4.127 bits with double quantization)."""
GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: parameter counts and the widths activations scale with."""

    params: int
    """Every parameter (tied embeddings once)."""
    linear_params: int
    """Weights of the decoder layers' linear maps (what a 4-bit base quantizes)."""
    layer_params: tuple[int, ...]
    """Parameters of each decoder layer."""
    lora_params: int
    """Adapter parameters of the run's LoRA config (targets and layers)."""
    vocab: int
    hidden: int
    intermediate: int
    heads: int
    kv_width: int
    """Key/value projection width (kv heads x head dim)."""

    @property
    def layers(self) -> int:
        return len(self.layer_params)


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for before, part in pairwise(parts):
        if before == "layers" and part.isdigit():
            return int(part)
    return None


def shape_of(model: nn.Module, run: RunConfig) -> ModelShape:
    """``model``'s shape (on any device, the meta device included) under ``run``'s LoRA."""
    config: Any = model.config
    lora = run.finetune.lora
    layer_params: dict[int, int] = {}
    linear = lora_params = 0
    for name, module in model.named_modules():
        index = _layer_index(name)
        if isinstance(module, nn.Linear) and index is not None:
            linear += module.weight.numel()
            chosen = lora.layers is None or index in lora.layers
            if chosen and name.rsplit(".", 1)[-1] in lora.target_modules:
                lora_params += lora.r * (module.in_features + module.out_features)
    for name, param in model.named_parameters():
        index = _layer_index(name)
        if index is not None:
            layer_params[index] = layer_params.get(index, 0) + param.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()) - _untied_copy(model, tied),
        linear_params=linear,
        layer_params=tuple(layer_params[i] for i in sorted(layer_params)),
        lora_params=lora_params,
        vocab=config.vocab_size,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=heads,
        kv_width=kv_heads * head_dim,
    )


def _untied_copy(model: nn.Module, tied: bool) -> int:
    """The output embedding's size when the config ties it to the input embedding but the
    meta-device build left them apart (``init_empty_weights`` replaces parameters after tying)."""
    if not tied:
        return 0
    out = model.get_output_embeddings()  # type: ignore[operator]
    inp = model.get_input_embeddings()  # type: ignore[operator]
    if out is None or inp is None or out.weight is inp.weight:
        return 0
    return int(out.weight.numel())


def meta_model(run: RunConfig) -> nn.Module:
    """The run's model with its parameters on the meta device: built from the built-in tiny
    config, or from the config.json of ``model.name_or_path`` (no weights read)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from forgetless.models.tiny import build_char_tokenizer, build_tiny_model

    with init_empty_weights():
        if run.model.name_or_path is None:
            return build_tiny_model(run.model.tiny, len(build_char_tokenizer()), seed=run.seed)
        source = _config_source(run)
        try:
            config = AutoConfig.from_pretrained(
                source, revision=run.model.revision, trust_remote_code=run.model.trust_remote_code
            )
        except (OSError, ValueError) as err:
            raise ModelLoadError(
                f"model.name_or_path: cannot read the config of {source!r}: {_first_line(err)}"
            ) from None
        model: nn.Module = AutoModelForCausalLM.from_config(
            config, trust_remote_code=run.model.trust_remote_code
        )
        return model


def _config_source(run: RunConfig) -> str:
    """A folder holding config.json (weights not needed), else what ``resolve_source`` says."""
    name = str(run.model.name_or_path)
    folder = Path(name).expanduser()
    if (folder / "config.json").is_file():
        return str(folder)
    from forgetless.models.loading import resolve_source

    return resolve_source(name)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@dataclass(frozen=True)
class Setting:
    """What the plan reads of a run besides the model: precision, batch, fine-tuning mode."""

    weight_bytes: float
    act_bytes: int
    batch: int
    length: int
    lora: bool
    quantized: bool
    checkpointing: bool
    eager: bool
    tasks: int

    @classmethod
    def of(cls, run: RunConfig, checkpointing: bool) -> Setting:
        quant = run.model.quantization
        dtype = quant.compute_dtype if quant is not None else run.model.dtype
        half = dtype != "float32" or run.train.autocast == "bf16"
        return cls(
            weight_bytes=DTYPES[dtype].itemsize,
            act_bytes=2 if half else 4,
            batch=run.train.batch_size,
            length=run.train.resolved_max_length,
            lora=run.finetune.mode == "lora",
            quantized=quant is not None,
            checkpointing=checkpointing,
            eager=run.model.attn_implementation == "eager",
            tasks=len(run.tasks),
        )

    @property
    def tokens(self) -> int:
        return self.batch * self.length


@dataclass(frozen=True)
class Plan:
    """Predicted bytes per device of one method's training step, by component."""

    method: str
    weights: float
    gradients: float
    optimizer: float
    method_state: float
    activations: float
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        """Weights, AdamW's moments (kept from the step before) and the method's state, plus
        the larger of activations and gradients: the backward pass frees each layer's saved
        activations as it writes that layer's gradients, so the two never peak together."""
        held = self.weights + self.optimizer + self.method_state
        return held + max(self.activations, self.gradients)

    def row(self) -> dict[str, float | str]:
        parts = ("weights", "gradients", "optimizer", "method_state", "activations", "peak")
        return {"method": self.method, **{p: float(getattr(self, p)) for p in parts}}


def trainable_count(shape: ModelShape, method: str, config: Any, lora: bool) -> int:
    """Parameters the optimizer sees: the adapters under LoRA, else all, save what the method
    freezes (``freeze``: all but its layers; ``block_expansion``: all but its new blocks)."""
    if lora:
        return shape.lora_params
    if method == "freeze":
        chosen = config.layers or range(shape.layers - config.train_top_layers, shape.layers)
        inside = sum(shape.layer_params[i] for i in chosen if 0 <= i < shape.layers)
        outside = shape.params - sum(shape.layer_params)
        return inside + (0 if config.freeze_embeddings else outside)
    if method == "block_expansion":
        return new_blocks(shape, config) * shape.layer_params[0]
    return shape.params


def new_blocks(shape: ModelShape, config: Any) -> int:
    """Block expansion's inserted blocks: as configured, else one per group of 4 layers."""
    return int(config.num_new_blocks or max(1, shape.layers // 4))


def weight_bytes(shape: ModelShape, s: Setting) -> float:
    """The model's weights, adapters included."""
    adapters = shape.lora_params * ADAPTER_BYTES if s.lora else 0
    if s.quantized:
        rest = shape.params - shape.linear_params
        return shape.linear_params * NF4_BYTES + rest * s.weight_bytes + adapters
    return shape.params * s.weight_bytes + adapters


def layer_activation_bytes(shape: ModelShape, s: Setting) -> float:
    """One decoder layer's saved activations for the whole micro-batch (module docstring)."""
    h, kv, i, a = shape.hidden, shape.kv_width, shape.intermediate, s.act_bytes
    norms = 2 * h * 4 + 2 * h * a + (0 if s.lora else 2 * h * 4)
    attention = (3 * h + 2 * kv) * a
    mlp = 4 * i * a
    eager = 2 * shape.heads * s.length * a if s.eager else 0
    return s.tokens * (norms + attention + mlp + eager)


def logits_bytes(shape: ModelShape, s: Setting) -> float:
    """The logits at the loss: the model's, a float32 shifted copy, log-softmax and its grad."""
    return s.tokens * shape.vocab * (s.act_bytes + 12)


def activation_bytes(shape: ModelShape, s: Setting) -> float:
    """Every activation a backward pass needs, with or without gradient checkpointing."""
    layer = layer_activation_bytes(shape, s)
    ends = s.tokens * shape.hidden * (4 + s.act_bytes)  # embedding output + final norm
    if s.checkpointing:
        kept = s.tokens * shape.hidden * s.weight_bytes * shape.layers
        return kept + layer + ends + logits_bytes(shape, s)
    return layer * shape.layers + ends + logits_bytes(shape, s)


StateFn = Callable[[ModelShape, Setting, Any, int], float]
"""A method's own bytes from the model's shape, the setting, its config and the trainable
count."""


def _copies(n: float) -> StateFn:
    """``n`` copies of the trainable weights, at their dtype."""
    return lambda shape, s, config, trainable: n * trainable * _trainable_bytes(s)


def _model_copy(shape: ModelShape, s: Setting) -> float:
    return shape.params * s.weight_bytes


def _kl_at_logits(shape: ModelShape, s: Setting) -> float:
    """A token KL to a reference: the reference's logits, then four float32 logit-sized
    tensors (both log-softmaxes, the probabilities the KL weighs by, and its gradient)."""
    return s.tokens * shape.vocab * (s.act_bytes + 16)


def _base_reference_kl(shape: ModelShape, s: Setting, config: Any, trainable: int) -> float:
    """KL-SFT's and ASFT's: the KL at the logits, and a whole reference copy only without LoRA
    (under LoRA the model with its adapters switched off is the reference)."""
    copy = 0.0 if s.lora else _model_copy(shape, s)
    return copy + _kl_at_logits(shape, s)


def _anchored(shape: ModelShape, s: Setting, config: Any, trainable: int) -> float:
    """Frozen copies of the SFT reference and of θ(t), adapters included."""
    adapters = shape.lora_params * ADAPTER_BYTES if s.lora else 0
    return 2 * (_model_copy(shape, s) + adapters)


def _attribution(shape: ModelShape, s: Setting, config: Any, trainable: int) -> float:
    """The map R̄ (``map_dtype``), the gate factors and the loop's pre-step snapshot."""
    return trainable * (DTYPES[config.map_dtype].itemsize + 2 * _trainable_bytes(s))


def _sae_fd(shape: ModelShape, s: Setting, config: Any, trainable: int) -> float:
    """A gated SAE of D = expansion·h features (encoder, decoder, gate and magnitude biases,
    float32) and the anchor buffer of the past tasks at its dtype, with token ids."""
    d = shape.hidden
    features = config.sae.expansion * d
    sae = (2 * d * features + 3 * features + d) * 4
    per_token = d * DTYPES[config.anchor_dtype].itemsize + 4
    anchors = config.anchor_samples * max(0, s.tasks - 1) * s.length * per_token
    return sae + anchors


def _replay(shape: ModelShape, s: Setting, config: Any, trainable: int) -> float:
    """The buffer's examples: input ids, labels and mask as int64 at most ``T`` tokens."""
    return config.buffer_size * s.length * 3 * 8


def _o_lora(shape: ModelShape, s: Setting, config: Any, trainable: int) -> float:
    """The past tasks' frozen adapters (at the last task: one per earlier task)."""
    return max(0, s.tasks - 1) * shape.lora_params * ADAPTER_BYTES


def _sdft(shape: ModelShape, s: Setting, config: Any, trainable: int) -> float:
    """The EMA teacher: a whole copy of the student, adapters included, and the distillation
    at the logits."""
    adapters = shape.lora_params * ADAPTER_BYTES if s.lora else 0
    return _model_copy(shape, s) + adapters + _kl_at_logits(shape, s)


def _block_expansion(shape: ModelShape, s: Setting, config: Any, trainable: int) -> float:
    """The inserted blocks' weights (their gradients and moments count as trainable)."""
    return new_blocks(shape, config) * shape.layer_params[0] * s.weight_bytes


def _trainable_bytes(s: Setting) -> int:
    return ADAPTER_BYTES if s.lora else int(s.weight_bytes)


METHOD_STATE: dict[str, StateFn] = {
    "ewc": _copies(2),  # float32 Fisher is the weights' width on a float32 run; anchor: a clone
    "kl_sft": _base_reference_kl,
    "asft": _base_reference_kl,
    "anchored": _anchored,
    "attribution_gate": _attribution,
    "sae_fd": _sae_fd,
    "replay": _replay,
    "o_lora": _o_lora,
    "sdft": _sdft,
    "rl": lambda shape, s, config, trainable: _model_copy(shape, s) if config.beta > 0 else 0.0,
    "block_expansion": _block_expansion,
    "task_arithmetic": _copies(2),  # the task's start and the merged state
    "ties": _copies(2),
    "opcm": _copies(2),
}
"""Each method's own device memory beyond the model, gradients and AdamW (read from its file);
a method not named keeps nothing weight- or token-sized. An outside method declares its own
with a classmethod ``memory_state(shape, setting, config, trainable) -> bytes``."""

EXTRA_ROWS: dict[str, Callable[[Any], float]] = {
    "sae_fd": lambda config: config.anchor_batch_fraction,
}
"""Rows a method adds to each micro-batch, as a share of it (SAE-FD's anchor samples join the
batch, or run a second forward of as many rows with ``anchor_forward: separate``)."""

NOTES = {
    "anchored": "its top-k anchor cache (token-sized) is not counted",
    "rl": "TRL's GRPO stage (generation, its own optimizer) is not planned: SFT stage only",
    "sdft": "generation's KV cache is not counted",
}


def method_state(name: str, shape: ModelShape, s: Setting, config: Any, trainable: int) -> float:
    cls = registry.lookup(name)
    own = getattr(cls, "memory_state", None)
    if own is not None:
        return float(own(shape, s, config, trainable))
    fn = METHOD_STATE.get(name)
    return float(fn(shape, s, config, trainable)) if fn else 0.0


def plan_method(
    shape: ModelShape, run: RunConfig, config: Any, checkpointing: bool | None = None
) -> Plan:
    """The predicted peak of one training step of the method ``config`` in ``run``'s setting;
    ``checkpointing`` None reads ``train.gradient_checkpointing`` when the config has it."""
    if checkpointing is None:
        checkpointing = bool(getattr(run.train, "gradient_checkpointing", False))
    s = Setting.of(run, checkpointing)
    extra = EXTRA_ROWS.get(config.name)
    rows = s.batch + (math.ceil(s.batch * extra(config)) if extra else 0)
    grown = replace(s, batch=rows)
    lora = s.lora
    trainable = trainable_count(shape, config.name, config, lora)
    width = _trainable_bytes(s)
    return Plan(
        method=config.name,
        weights=weight_bytes(shape, s),
        gradients=trainable * width,
        optimizer=2 * trainable * width,
        method_state=method_state(config.name, shape, s, config, trainable),
        activations=activation_bytes(shape, grown),
        notes=[NOTES[config.name]] if config.name in NOTES else [],
    )


def selected_methods(run: RunConfig, names: str | None) -> list[Any]:
    """The run's method config, or each of the comma-separated ``names`` at its defaults."""
    if not names:
        return [run.method]
    from forgetless.config.schema import method_config

    try:
        return [method_config(n.strip()) for n in names.split(",") if n.strip()]
    except ValueError as err:
        raise ConfigError(f"--methods: {err}") from None


def plans(run: RunConfig, names: str | None = None) -> tuple[ModelShape, list[tuple[Plan, Plan]]]:
    """The model's shape and, per selected method, its plan without and with checkpointing."""
    shape = shape_of(meta_model(run), run)
    rows = [
        (plan_method(shape, run, m, False), plan_method(shape, run, m, True))
        for m in selected_methods(run, names)
    ]
    return shape, rows


def unit_for(rows: list[tuple[Plan, Plan]]) -> tuple[str, float]:
    """MB for a plan whose largest peak is under a GB, else GB."""
    largest = max((p.peak for pair in rows for p in pair), default=0.0)
    return ("GB", GB) if largest >= GB else ("MB", 1e6)
