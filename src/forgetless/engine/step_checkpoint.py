"""Step checkpoints inside a task: weights, optimizer, scheduler, RNG, data order, method state.

Every ``train.checkpoint_every`` optimizer steps, and once more when the task's training ends
(so a crash in end-of-task work does not retrain the task), the step loop writes one folder per
task (``checkpoints/step-NN-<task>``, replaced atomically). A re-run restores it and goes on from
the next step: the data order is replayed from the task's seed, so the batches are those an
uninterrupted run draws. Tensors go to safetensors, everything else to JSON (never pickle).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from forgetless.core import sharding
from forgetless.core.storage import (
    atomic_dir,
    load_method_state,
    read_tensors,
    save_method_state,
)
from forgetless.errors import CheckpointError

if TYPE_CHECKING:  # the methods package imports the step loop, which imports this module
    from forgetless.contract.method import Method

TENSORS = "step_state.safetensors"
META = "step_state.json"


@dataclass
class LoopProgress:
    """What the step loop has accumulated so far in one task (restored on resume)."""

    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    final_loss: float = float("nan")
    sums: dict[str, float] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    skipped: list[tuple[int, str, float]] = field(default_factory=list)
    scaler: dict[str, Any] = field(default_factory=dict)
    """The fp16 gradient scaler's state, and the steps it skipped (``scaler_skipped``)."""
    padding: list[int] = field(default_factory=lambda: [0, 0])
    """Pad tokens and token slots of the micro-batches run so far."""


def plan_fingerprint(plan: Any) -> dict[str, Any]:
    """The plan fields a step checkpoint must agree with to be resumed."""
    keys = ("steps", "batch_size", "lr", "seed", "grad_accum", "scheduler", "warmup_steps")
    return {k: getattr(plan, k) for k in keys}


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = state
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    meta = {
        "python": _to_lists(random.getstate()),
        "numpy": [kind, np.asarray(keys).tolist(), pos, has_gauss, gauss],
    }
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["rng/torch"])
    cuda = sorted(k for k in tensors if k.startswith("rng/cuda/"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, tuple | list) else value


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], Any]:
    """The optimizer's tensors (a sharded moment gathered whole: every process must call it)
    and the rest as JSON."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for index, entries in state["state"].items():
        per_param[str(index)] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                whole = sharding.replicated(value.detach())
                tensors[f"optim/{index}/{key}"] = whole.cpu().contiguous()
            else:
                per_param[str(index)][key] = value
    return tensors, {"groups": _to_lists(state["param_groups"]), "scalars": per_param}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: Any
) -> None:
    """Restore what :func:`optimizer_state` saved, each moment split like its parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in meta["scalars"].items()}
    for name, tensor in tensors.items():
        if name.startswith("optim/"):
            _, index, key = name.split("/", 2)
            value = sharding.split_like(tensor, params[int(index)]) if key != "step" else tensor
            state.setdefault(int(index), {})[key] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


@dataclass
class StepCheckpointer:
    """Saves and restores one task's step checkpoint in ``folder``."""

    folder: Path
    every: int
    method: Method
    fingerprint: dict[str, Any]

    def due(self, done: int, total: int) -> bool:
        return done == total or done % self.every == 0

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        progress: LoopProgress,
    ) -> None:
        weights = {  # sharded: gathered whole, so the file is a one-process run's
            n: sharding.replicated(p.detach()).cpu().contiguous()
            for n, p in model.named_parameters()
            if p.requires_grad
        }
        optim_tensors, optim_meta = optimizer_state(optimizer)
        rng_tensors, rng_meta = rng_state()
        meta = {
            "plan": self.fingerprint,
            "progress": asdict(progress),
            "optimizer": optim_meta,
            "scheduler": scheduler.state_dict(),
            "rng": rng_meta,
        }
        method_state = sharding.gather_state(self.method.state_dict())
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(self.folder) as tmp:
            save_file(
                {**{f"weights/{n}": t for n, t in weights.items()}, **optim_tensors, **rng_tensors},
                str(tmp / TENSORS),
            )
            save_method_state(tmp, method_state)
            (tmp / META).write_text(json.dumps(meta, allow_nan=True), encoding="utf-8")

    def resume(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> LoopProgress | None:
        """Restore the saved step into the objects given; None when there is none to resume."""
        if not (self.folder / META).is_file():
            return None
        try:
            meta = json.loads((self.folder / META).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{self.folder / META}: unreadable ({err})") from None
        if not isinstance(meta, dict) or meta.get("plan") != self.fingerprint:
            return None  # another plan (the config changed under --allow-config-change)
        tensors = read_tensors(self.folder / TENSORS)
        try:
            self._load_weights(model, tensors)
            load_optimizer_state(optimizer, tensors, meta["optimizer"])
            scheduler.load_state_dict(meta["scheduler"])
            method_state = sharding.shard_state_like(load_method_state(self.folder), model)
            self.method.load_state_dict(method_state)
            set_rng_state(tensors, meta["rng"])
            saved = meta["progress"]
            saved["skipped"] = [tuple(s) for s in saved["skipped"]]
            return LoopProgress(**saved)
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise CheckpointError(
                f"{self.folder}: damaged step checkpoint ({type(err).__name__}: {err}); "
                "remove the folder to restart the task"
            ) from None

    def _load_weights(self, model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        missing = sorted(set(trainable) - {k[len("weights/") :] for k in tensors})
        if missing:
            raise CheckpointError(
                f"{self.folder / TENSORS}: lacks trainable tensor {missing[0]!r}: "
                "the step checkpoint is from another model or fine-tuning mode"
            )
        with torch.no_grad():
            for name, param in trainable.items():
                saved = tensors[f"weights/{name}"]
                if saved.shape != param.shape:
                    raise CheckpointError(
                        f"{self.folder / TENSORS}: tensor {name!r} has shape {list(saved.shape)}, "
                        f"the model's is {list(param.shape)}"
                    )
                param.copy_(sharding.split_like(saved.to(param.dtype), param))
