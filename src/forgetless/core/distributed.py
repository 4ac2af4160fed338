"""Data parallelism over the processes that ``accelerate launch`` starts (DDP semantics).

Every process holds the whole, unwrapped model, so each method hook sees the same named parameters
everywhere. A step draws the same global micro-batch on every process (same seed), applies the
method's batch transform to it, and each process keeps its own slice. Each process scales its loss
by its share of the micro-batch's labelled tokens and the gradients are summed across processes,
so the summed gradient is the gradient of the global token mean: 2 processes × batch b/2 take the
step 1 process × batch b takes, to float tolerance. Parameter-only terms (EWC, O-LoRA) are the same
everywhere and their shares add up to 1. Only the main process writes files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from accelerate import PartialState
from torch import nn

from forgetless.errors import ConfigError

T = TypeVar("T")
SHARDED_TYPES = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


_local = False


def _joined() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Processes that train together (1 inside ``local_only``)."""
    return dist.get_world_size() if _joined() and not _local else 1


def rank() -> int:
    return dist.get_rank() if _joined() else 0


def is_main_process() -> bool:
    return rank() == 0


@contextmanager
def local_only() -> Iterator[None]:
    """Work inside runs on this process alone: no collective calls, no data sharding."""
    global _local
    before, _local = _local, True
    try:
        yield
    finally:
        _local = before


def main_first(build: Callable[[], T]) -> T:
    """Run ``build`` on the main process, then on the others (which find what it cached).

    For work that fills a cache on disk (pretraining the base, training an SAE): it is done
    once, and the other processes read it only after the main process has written it.
    """
    if not _joined() or dist.get_world_size() == 1:
        return build()
    if is_main_process():
        with local_only():
            out = build()
    dist.barrier()
    if not is_main_process():
        with local_only():
            out = build()
    return out


SHARDED_LAUNCH_FLAGS = {
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_DEEPSPEED": "DEEPSPEED",
    "ACCELERATE_USE_MEGATRON_LM": "MEGATRON_LM",
}
"""What ``accelerate launch`` sets for a sharded config. ``PartialState`` reports only DeepSpeed
and XLA (FSDP is decided later, by ``AcceleratorState``, and on CPU not at all), so a sharded
launch is read from these too."""


def start() -> PartialState:
    """Join the process group that ``accelerate launch`` set up (a no-op for one process)."""
    state = PartialState()
    kind = str(state.distributed_type).rsplit(".", 1)[-1]
    flagged = [v for k, v in SHARDED_LAUNCH_FLAGS.items() if _truthy(os.environ.get(k, ""))]
    kind = flagged[0] if flagged else kind
    if kind in SHARDED_TYPES:
        raise ConfigError(
            f"accelerate config: distributed_type {kind} shards the model, which forgetless does "
            "not support yet; use a MULTI_GPU or MULTI_CPU (data-parallel) config "
            "(see examples/accelerate/)"
        )
    return state


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes")


def launch_warning() -> str | None:
    """A warning for ``accelerate launch --cpu --num_processes N``, which starts one process
    unless mpirun is set up (accelerate's MULTI_CPU launcher goes through MPI)."""
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    if cpu and "MASTER_PORT" in os.environ and "WORLD_SIZE" not in os.environ:
        return (
            "warning: accelerate launch --cpu started 1 process (it needs mpirun for more); "
            "for N CPU processes use --multi_gpu --num_processes N, or "
            "examples/accelerate/cpu_2proc.yaml"
        )
    return None


def check_batch(batch_size: int, where: str) -> None:
    """Each process needs at least one example of every micro-batch."""
    if batch_size < world_size():
        raise ConfigError(
            f"{where}: batch_size {batch_size} is smaller than the {world_size()} processes; "
            "each process needs at least one example per micro-batch"
        )


def shard(items: Sequence[T]) -> list[T]:
    """This process's contiguous slice of a global micro-batch (sizes differ by at most one)."""
    n, size, me = len(items), world_size(), rank()
    if size == 1:
        return list(items)
    base, extra = divmod(n, size)
    lo = me * base + min(me, extra)
    return list(items[lo : lo + base + (1 if me < extra else 0)])


def labelled_tokens(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Next-token targets in a batch: the positions a token-mean loss averages over."""
    return (labels[:, 1:] != ignore_index).sum().to(torch.float64)


def token_share(local: torch.Tensor) -> float:
    """This process's share of the micro-batch's labelled tokens (1.0 for one process)."""
    size = world_size()
    if size == 1:
        return 1.0
    total = _on_comm_device(local.detach().clone())
    dist.all_reduce(total)
    return float(local) / float(total) if float(total) > 0 else 1.0 / size


def weighted_sum(values: torch.Tensor, share: float) -> torch.Tensor:
    """Σ over processes of ``share · values``: the global value of token-mean quantities."""
    if world_size() == 1:
        return values
    out = _on_comm_device(values.detach().to(torch.float64) * share)
    dist.all_reduce(out)
    return out.to(values.device, values.dtype)


def sum_gradients(params: Sequence[nn.Parameter]) -> None:
    """Sum the gradients of ``params`` over the processes, in one flattened all-reduce."""
    if world_size() == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for param, grad in zip(params, grads, strict=True):
        n = grad.numel()
        param.grad = flat[offset : offset + n].view_as(grad).to(grad.dtype)
        offset += n


_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX"}


def reduce_state(state: Mapping[str, Any], ops: Mapping[str, str], prefix: str = "") -> Any:
    """Reduce the tensors of a method's state whose top-level key has an op in ``ops``.

    ``mean`` averages, ``sum`` adds, ``max`` takes the element-wise maximum over processes;
    tensors under other keys are left as they are (each process computed them the same way).
    """
    if world_size() == 1:
        return dict(state)
    out: dict[str, Any] = {}
    for key, value in state.items():
        top = prefix or key  # nested dicts take the op of their top-level key
        op = ops.get(top)
        if isinstance(value, Mapping):
            out[key] = reduce_state(value, ops, top)
        elif isinstance(value, torch.Tensor) and op is not None:
            out[key] = _reduce_tensor(value, op)
        else:
            out[key] = value
    return out


def _reduce_tensor(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce in float32 (or the tensor's own dtype for an integer ``max``), then cast back."""
    exact_int = op == "max" and not tensor.is_floating_point()
    wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    work = _on_comm_device(tensor.detach().to(tensor.dtype if exact_int else wide))
    dist.all_reduce(work, op=getattr(dist.ReduceOp, _OPS[op]))
    if op == "mean":
        work = work / world_size()
    return work.to(tensor.device, tensor.dtype)


def _on_comm_device(tensor: torch.Tensor) -> torch.Tensor:
    """NCCL reduces CUDA tensors only, gloo CPU ones: move to the process group's device."""
    backend = dist.get_backend()
    device = PartialState().device if backend == "nccl" else torch.device("cpu")
    return tensor.to(device)


def barrier() -> None:
    if _joined() and dist.get_world_size() > 1:
        dist.barrier()
