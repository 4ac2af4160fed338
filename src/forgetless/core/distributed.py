"""Data parallelism over the processes that ``accelerate launch`` starts.

Every process holds the whole model, so each method hook sees the same named parameters
everywhere. A step draws the same global micro-batch on every process (same seed), applies the
method's batch transform to it, and each process keeps its own slice. The training forward goes
through the model as accelerate wraps it (``for_training``: DistributedDataParallel), whose
reducer averages the gradients during the backward pass; each process scales its loss by its
share of the micro-batch's labelled tokens times the number of processes, so the averaged
gradient is the gradient of the global token mean: 2 processes × batch b/2 take the step
1 process × batch b takes, to float tolerance. Parameter-only terms (EWC, O-LoRA) are the same
everywhere and their shares add up to 1. Only the main process writes files. Under an FSDP2
launch the runner shards the model instead (``forgetless.core.sharding``) and FSDP
reduce-scatters the gradients; the loss scaling is the same. Under a DeepSpeed ZeRO-1/2 launch
the loop trains through the engine accelerate prepares (``forgetless.core.zero``), which reduces
the gradients and steps the optimizer; the loss scaling is again the same.
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

from forgetless.core import zero
from forgetless.core.sharding import fsdp_launch, is_sharded, truthy
from forgetless.errors import ConfigError

T = TypeVar("T")
SHARDED_TYPES = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


_local = False
_accelerator: Any = None


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
    """Join the process group that ``accelerate launch`` set up (a no-op for one process).

    On a machine without a GPU, accelerate is told so (``cpu=True``): otherwise it sees no
    device, reports no distributed setting and would leave the model unwrapped.
    """
    if zero.launched():  # ZeRO-1/2: the loop trains through accelerate's DeepSpeed engine
        zero.check_launch(zero.stage())
        return PartialState(cpu=False)  # DS_ACCELERATOR=cpu picks DeepSpeed's CPU backend
    state = PartialState(cpu=not torch.cuda.is_available())
    kind = str(state.distributed_type).rsplit(".", 1)[-1]
    flagged = [v for k, v in SHARDED_LAUNCH_FLAGS.items() if truthy(os.environ.get(k, ""))]
    kind = flagged[0] if flagged else kind
    if kind == "FSDP" and fsdp_launch() == 2:
        return state  # FSDP2: the runner shards the model (core.sharding)
    if kind in SHARDED_TYPES:
        why = "FSDP version 1 is not supported" if kind == "FSDP" else f"{kind} is not supported"
        raise ConfigError(
            f"accelerate config: distributed_type {kind}: {why}; use an FSDP version 2 config "
            "or a data-parallel one (see examples/accelerate/)"
        )
    return state


def layout() -> str:
    """How the processes split the training: ``single``, ``ddp``, ``fsdp2``, ``zero1`` or
    ``zero2`` (DeepSpeed)."""
    if world_size() == 1:
        return "single"
    return "fsdp2" if sharded() else f"zero{zero.stage()}" if zero.launched() else "ddp"


def sharded() -> bool:
    """Whether this run shards its model (an FSDP2 launch of more than one process)."""
    return world_size() > 1 and fsdp_launch() == 2


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


def weighted_sum(values: torch.Tensor, share: float) -> torch.Tensor:
    """Σ over processes of ``share · values``: the global value of token-mean quantities."""
    if world_size() == 1:
        return values
    out = _on_comm_device(values.detach().to(torch.float64) * share)
    dist.all_reduce(out)
    return out.to(values.device, values.dtype)


def _training_accelerator() -> Any:
    """One accelerate ``Accelerator`` for the process: DDP with unused parameters allowed (a
    method may leave some without a gradient) and buffers left as they are."""
    global _accelerator
    if _accelerator is None:
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        handler = DistributedDataParallelKwargs(
            find_unused_parameters=True, broadcast_buffers=False
        )
        _accelerator = Accelerator(
            cpu=not torch.cuda.is_available() and not zero.launched(),
            mixed_precision="no",
            kwargs_handlers=[handler],
        )
    return _accelerator


@contextmanager
def zero_engine(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch_size: int, max_grad_norm: float | None
) -> Iterator[zero.ZeroEngine | None]:
    """The DeepSpeed engine one training loop goes through under a ZeRO-1/2 launch of more
    than one process, else None (the loop steps its optimizer itself)."""
    if world_size() == 1 or not zero.launched():
        yield None
        return
    settings = zero.ds_settings(batch_size, world_size(), max_grad_norm)
    with zero.engine_for(_training_accelerator(), model, optimizer, settings) as engine:
        yield engine


@contextmanager
def for_training(model: nn.Module) -> Iterator[nn.Module]:
    """The module the training forward goes through: ``model`` as accelerate prepares it for
    several processes (DistributedDataParallel, which reduces the gradients), ``model`` itself
    for one. Hooks, snapshots and checkpoints keep using ``model``; a backward pass that did not
    start from the wrapper's forward (a Fisher, a relevance map) stays local."""
    if world_size() == 1 or is_sharded(model) or zero.launched():
        yield model  # FSDP2 reduce-scatters the gradients itself, DeepSpeed's engine reduces them
        return
    accelerator = _training_accelerator()
    wrapped = accelerator.prepare_model(model, device_placement=False)
    if wrapped is model:  # nothing would reduce the gradients: the processes would drift apart
        raise ConfigError(
            f"accelerate ({accelerator.distributed_type}) did not wrap the model for "
            f"{world_size()} processes; launch with accelerate launch or torchrun"
        )
    try:
        yield wrapped
    finally:
        accelerator.free_memory()


def scale_for_reduction(loss: torch.Tensor, share: float) -> torch.Tensor:
    """This process's loss before the wrapper averages gradients over the processes: its share
    of the global token mean, times the number of processes (1 process: unchanged)."""
    size = world_size()
    return loss if size == 1 else loss * (share * size)


def parameter_term(value: torch.Tensor, share: float) -> torch.Tensor:
    """A loss term that depends on the parameters only (a penalty toward an anchor), as a
    process adds it. Under DDP every process adds it whole and the reducer averages. Under FSDP2
    its gradient reaches each process's shard directly, outside FSDP's averaging, so it is
    divided here by what ``scale_for_reduction`` multiplies: the shard gets the term's own
    gradient, and the token-share-weighted sum that is logged is still the term."""
    if not sharded():
        return value
    return value / (share * world_size())


@contextmanager
def no_gradient_sync(wrapped: nn.Module, skip: bool) -> Iterator[None]:
    """Let a micro-batch's gradients accumulate locally (``skip``): the wrapper reduces once,
    on the step's last micro-batch."""
    if skip and is_sharded(wrapped):
        wrapped.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)  # type: ignore[operator]
        return
    sync_off: Any = getattr(wrapped, "no_sync", None) if skip else None
    if sync_off is None:
        yield
        return
    with sync_off():
        yield


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
