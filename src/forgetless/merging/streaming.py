"""Merge task checkpoints into a base model one tensor at a time, from and to safetensors.

For each weight of the base only that tensor and the matching tensor (or LoRA factors) of every
task are in memory; the merged tensor is appended to the output file, whose header is written
first from the base's shapes, so peak memory stays near one layer's worth per model.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from forgetless.core.dtypes import DTYPES
from forgetless.core.lowrank import LowRank
from forgetless.core.ownership import check_output_folder, replace_output
from forgetless.core.storage import atomic_write_json, temp_file_name, tensor_shapes
from forgetless.core.tensor_files import TIED, WEIGHTS_FILE, TensorFiles, adapter_terms
from forgetless.errors import ConfigError
from forgetless.merging.blocks import is_block_matrix
from forgetless.merging.config import MERGE_METHODS, MergeConfig, OPCMMerge
from forgetless.merging.dare import dare_merge
from forgetless.merging.linear import combine, linear_update
from forgetless.merging.opcm import opcm_accumulate, opcm_lambda
from forgetless.merging.task_arithmetic import COMPUTE, task_vector
from forgetless.merging.ties import ties_merge

COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
Delta = torch.Tensor | LowRank


class StreamWriter:
    """A safetensors file written tensor by tensor in a fixed order, then renamed into place."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in specs:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape)}
            header[name]["data_offsets"] = [offset, offset + size]
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.path, self.tmp = path, temp_file_name(path)
        self.order = [(name, dtype, tuple(shape)) for name, dtype, shape in specs]
        self.done = 0
        self.handle: BinaryIO = self.tmp.open("wb")
        self.handle.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self.order[self.done]
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != want:
            raise ValueError(f"StreamWriter expected {want}, got {got}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self.handle.write(data.numpy().tobytes())
        self.done += 1

    def close(self) -> None:
        """Flush, check every tensor came, and rename the temp file over ``path``."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        if self.done != len(self.order):
            self.tmp.unlink()
            raise ValueError(f"StreamWriter got {self.done} of {len(self.order)} tensors")
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.handle.close()
        self.tmp.unlink(missing_ok=True)


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no safetensors weights")
    return files


def adapter_key(module: str) -> str:
    """PEFT module path → the base weight it adapts (``base_model.model.X`` → ``X.weight``)."""
    prefix = "base_model.model."
    return (module[len(prefix) :] if module.startswith(prefix) else module) + ".weight"


def tensor_specs(files: TensorFiles) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from each file's safetensors header (one read per file)."""
    paths = dict.fromkeys(files.where.values())
    return {name: shape for path in paths for name, shape in tensor_shapes(path).items()}


Spec = tuple[str, torch.dtype, tuple[int, ...]]
"""A base tensor's name, dtype and shape."""


def read_files(folder: Path, files: list[Path]) -> TensorFiles:
    """``TensorFiles`` with a one-line error for a file that is not safetensors."""
    from safetensors import SafetensorError

    try:
        return TensorFiles(files)
    except (SafetensorError, OSError, ValueError) as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{folder}: unreadable weights ({why})") from None


class TaskSource:
    """One task: a full checkpoint (``θ_t − θ_base``) or a PEFT adapter (``s·B·A``, factored)."""

    def __init__(self, folder: Path) -> None:
        if not folder.is_dir():
            raise ConfigError(f"no such folder: {folder}")
        adapters = sorted(str(p.parent) for p in folder.glob("adapters/*/adapter_config.json"))
        if adapters and not (folder / "adapter_config.json").is_file():
            raise ConfigError(  # a LoRA run's task checkpoint keeps its adapters by name
                f"{folder} holds LoRA adapters, not a model's weights; give one: "
                + ", ".join(adapters)
            )
        self.folder = folder
        self.is_adapter = (folder / "adapter_config.json").is_file()
        self.changed_names: set[str] = set()
        """Base tensors this task's update changes (found during the merge; a rule that reads
        a delta twice, as OPCM does, finds the same name again)."""
        if self.is_adapter:
            try:
                terms = adapter_terms(folder)
            except (KeyError, ValueError, OSError) as err:
                raise ConfigError(f"{folder}: unreadable adapter ({err})") from None
            self.terms = {adapter_key(m): t for m, t in terms.items()}
        else:
            self.files = read_files(folder, weight_files(folder))

    def check_against(self, base: dict[str, tuple[int, ...]]) -> None:
        """Refuse a task whose tensors are not the base's: another model's names or shapes."""
        if self.is_adapter:
            shapes: dict[str, tuple[int, ...]] = {
                k: (t.left.shape[0], t.right.shape[1]) for k, t in self.terms.items()
            }
        else:
            shapes = {_base_name(k, base): v for k, v in tensor_specs(self.files).items()}
        if not shapes:
            raise ConfigError(f"{self.folder}: the task holds no tensor to merge")
        for name, shape in shapes.items():
            if name not in base:
                raise ConfigError(
                    f"{self.folder}: tensor {name!r} is not in the base model: the task is from "
                    "another model"
                )
            if tuple(shape) != base[name]:
                raise ConfigError(
                    f"{self.folder}: tensor {name!r} has shape {list(shape)}, the base's is "
                    f"{list(base[name])}: the task is from another model"
                )

    def delta(self, name: str, base: torch.Tensor) -> Delta | None:
        """This task's update of base weight ``name`` (None when it leaves it unchanged)."""
        if self.is_adapter:
            found: Delta | None = self.terms.get(name)
        else:
            aliases = [name, TIED.get(name), *(k for k, v in TIED.items() if v == name)]
            key = next((k for k in aliases if k is not None and k in self.files.where), None)
            found = None if key is None else task_vector(base, self.files.get(key))
        if found is not None and _nonzero(found):
            self.changed_names.add(name)
        return found

    @property
    def changed(self) -> int:
        return len(self.changed_names)


def _base_name(name: str, base: dict[str, tuple[int, ...]]) -> str:
    """A checkpoint's tensor name as the base calls it (a tied LM head is the embedding)."""
    return name if name in base else TIED.get(name, name)


def _nonzero(delta: Delta) -> bool:
    if isinstance(delta, LowRank):
        return bool(delta.left.any()) and bool(delta.right.any())
    return bool(delta.any())


def check_out(out: Path, cfg: MergeConfig) -> None:
    """Refuse an output folder that is a file, holds one of the merge's inputs, or holds
    anything but an earlier merge (``core.ownership``)."""
    check_output_folder(out, "merge", _inputs(cfg))


def _inputs(cfg: MergeConfig) -> dict[str, Path]:
    tasks = {f"tasks.{i}": t.path for i, t in enumerate(cfg.tasks)}
    return {"base_model": cfg.base_model, **tasks}


def dense(delta: Delta | None, like: torch.Tensor) -> torch.Tensor:
    if delta is None:
        return torch.zeros_like(like, dtype=COMPUTE)
    return delta.dense().to(COMPUTE) if isinstance(delta, LowRank) else delta.to(COMPUTE)


@dataclass
class MergeStats:
    """Per-tensor records of a merge (a rule's per-layer conflicts and gates, OPCM's λ)."""

    layers: dict[str, dict[str, float]] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)
    changed: list[int] = field(default_factory=list)
    """Per task, how many base tensors its update changed."""
    tensors: int = 0
    """Tensors in the merged model."""


@dataclass(frozen=True)
class TensorMerge:
    """What a merge rule sees of one tensor: its name and position, the base, the tasks' updates
    and weights, and where per-tensor records go."""

    name: str
    index: int
    base: torch.Tensor
    deltas: list[Delta | None]
    weights: list[float]
    stats: MergeStats

    def dense(self) -> list[torch.Tensor]:
        return [dense(d, self.base) for d in self.deltas]


def _task_arithmetic(params: Any, t: TensorMerge) -> torch.Tensor:
    return combine(t.dense(), t.weights, params.normalize, params.scaling)


def _ties(params: Any, t: TensorMerge) -> torch.Tensor:
    merged = ties_merge(t.dense(), params.density, t.weights, params.convention, params.normalize)
    return float(params.scaling) * merged


def _dare(params: Any, t: TensorMerge) -> torch.Tensor:
    return dare_merge(params, t.dense(), t.weights, t.index)


def _linear(params: Any, t: TensorMerge) -> torch.Tensor:
    return linear_update(t.base, t.dense(), t.weights, params.normalize)


TensorRule = Callable[[Any, TensorMerge], torch.Tensor]

TENSOR_RULES: dict[str, TensorRule] = {
    "task_arithmetic": _task_arithmetic,
    "ties": _ties,
    "dare": _dare,
    "linear": _linear,
}
"""The per-tensor merge of every rule but OPCM, whose λ needs a first pass over the model."""


def register_tensor_rule(name: str, rule: TensorRule) -> None:
    """Add the per-tensor merge of the config method ``name`` (the module that declares the
    method's config with ``register_merge_method`` does, beside it)."""
    TENSOR_RULES[name] = rule


def tensor_rule(name: str) -> TensorRule:
    """The registered rule of ``name``; one ConfigError line when its module did not add one."""
    if name not in TENSOR_RULES:
        declared = MERGE_METHODS.get(name)
        module = declared.__module__ if declared else "the module that declares it"
        raise ConfigError(
            f"method.name {name!r}: no per-tensor merge is registered for this method; "
            f"import {module} first (it registers one with register_tensor_rule)"
        )
    return TENSOR_RULES[name]


def merge_update(
    cfg: MergeConfig,
    name: str,
    index: int,
    base: torch.Tensor,
    deltas: list[Delta | None],
    stats: MergeStats,
) -> torch.Tensor:
    """The merged update of one tensor (float32), by the rule ``cfg.method`` names."""
    weights = [t.weight for t in cfg.tasks]
    tensor = TensorMerge(name, index, base, deltas, weights, stats)
    return tensor_rule(cfg.method.name)(cfg.method, tensor)


def _opcm_layer(
    name: str, base: torch.Tensor, deltas: list[Delta | None], alpha: float
) -> tuple[torch.Tensor, list[float]]:
    """``R_T`` of one tensor (tasks in order) and each task's squared update norm on it."""
    accumulated: torch.Tensor | None = None
    norms = []
    for d in deltas:
        delta = dense(d, base)
        norms.append(float(delta.pow(2).sum()))
        accumulated = opcm_accumulate(accumulated, delta, alpha, is_block_matrix(name, base))
    assert accumulated is not None
    return accumulated, norms


def _specs(files: TensorFiles) -> list[Spec]:
    from safetensors import safe_open

    by_name = {v: k for k, v in ST_DTYPES.items()}
    specs = []
    for name in files.names():
        with safe_open(str(files.where[name]), framework="pt") as handle:
            piece = handle.get_slice(name)
            specs.append((name, by_name[piece.get_dtype()], tuple(piece.get_shape())))
    return specs


def copy_model_files(base_dir: Path, out: Path) -> None:
    """config.json, generation config and tokenizer files (not weights or shard indexes)."""
    if not (base_dir / "config.json").is_file():
        raise ConfigError(f"base_model: {base_dir} has no config.json")
    for file_name in COPIED:
        if (base_dir / file_name).is_file():
            shutil.copy2(base_dir / file_name, out / file_name)


def checked_inputs(cfg: MergeConfig) -> tuple[TensorFiles, list[TaskSource], list[Spec]]:
    """The base's files, the tasks and the base's tensor specs, once every input is checked:
    the folders are there, each task's tensors are the base's, the rule is known. Reads
    headers only; ``merge --dry-run`` runs it too, so a plan it prints can be merged."""
    if not cfg.base_model.is_dir():
        raise ConfigError(f"base_model: no such folder: {cfg.base_model}")
    base = read_files(cfg.base_model, weight_files(cfg.base_model))
    specs = _specs(base)
    shapes = {name: shape for name, _, shape in specs}
    sources = []
    for index, task in enumerate(cfg.tasks):
        try:
            source = TaskSource(task.path)
            source.check_against(shapes)
        except ConfigError as err:
            raise ConfigError(f"tasks.{index}: {err}") from None
        sources.append(source)
    if not isinstance(cfg.method, OPCMMerge):
        tensor_rule(cfg.method.name)
    if not (cfg.base_model / "config.json").is_file():
        raise ConfigError(f"base_model: {cfg.base_model} has no config.json")
    return base, sources, specs


def stream_merge(
    cfg: MergeConfig, out: Path, progress: Callable[[str], None] | None = None
) -> MergeStats:
    """Write ``out/`` as a loadable HF model folder holding the merge (see module docstring)."""
    check_out(out, cfg)
    base, sources, specs = checked_inputs(cfg)
    out_dtype = DTYPES.get(cfg.dtype)
    specs = [(n, out_dtype if out_dtype and d.is_floating_point else d, s) for n, d, s in specs]
    stats, scale = MergeStats(), 1.0
    if isinstance(cfg.method, OPCMMerge):
        scale = _opcm_scale(base, sources, cfg.method.alpha, stats)
    with replace_output(out, "merge", _inputs(cfg)) as folder:
        copy_model_files(cfg.base_model, folder)
        _write_weights(cfg, base, sources, specs, (folder / WEIGHTS_FILE, scale), stats, progress)
        stats.changed, stats.tensors = [s.changed for s in sources], len(specs)
        record = {
            "config": cfg.model_dump(mode="json"),
            "changed_tensors": stats.changed,
            "layers": stats.layers,
            **stats.scalars,
        }
        atomic_write_json(folder / "merge.json", record)
    return stats


def _write_weights(
    cfg: MergeConfig,
    base: TensorFiles,
    sources: list[TaskSource],
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    target: tuple[Path, float],
    stats: MergeStats,
    progress: Callable[[str], None] | None,
) -> None:
    """Stream every merged tensor into ``target``'s file (OPCM divides by its scale)."""
    method = cfg.method
    writer = StreamWriter(target[0], specs)
    try:
        for index, (name, dtype, _) in enumerate(specs):
            theta = base.get(name)
            if theta.is_floating_point():
                deltas = [s.delta(name, theta) for s in sources]
                if isinstance(method, OPCMMerge):
                    update = _opcm_layer(name, theta, deltas, method.alpha)[0] / target[1]
                else:
                    update = merge_update(cfg, name, index, theta, deltas, stats)
                theta = theta.to(COMPUTE) + update
            writer.write(name, theta.to(dtype))
            if progress is not None:
                progress(name)
    except BaseException:
        writer.abort()
        raise
    writer.close()


def _opcm_scale(
    base: TensorFiles, sources: list[TaskSource], alpha: float, stats: MergeStats
) -> float:
    """First pass of OPCM: ``λ_T = ‖R_T‖ / mean_t ‖τ_t‖`` over the whole model."""
    r_sq, task_sq = 0.0, [0.0] * len(sources)
    for name in base.names():
        theta = base.get(name)
        if not theta.is_floating_point():
            continue
        accumulated, norms = _opcm_layer(
            name, theta, [s.delta(name, theta) for s in sources], alpha
        )
        r_sq += float(accumulated.pow(2).sum())
        task_sq = [a + b for a, b in zip(task_sq, norms, strict=True)]
    lam = opcm_lambda(r_sq**0.5, [v**0.5 for v in task_sq])
    stats.scalars["opcm_lambda"] = lam
    return lam
