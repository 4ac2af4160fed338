"""Sharded data parallelism (FSDP2) for runs that ``accelerate launch`` starts with an FSDP
version-2 config.

The model is split the way accelerate's FSDP2 plugin splits it: each transformer block (the
classes a ``transformers`` model lists in ``_no_split_modules``, or those named in the launch's
``FSDP_TRANSFORMER_CLS_TO_WRAP``) becomes one ``fully_shard`` unit, and the root takes the rest
(embeddings, final norm, output layer). accelerate 1.16 prepares FSDP only on GPU-family
devices, so forgetless calls torch's ``fully_shard`` itself, on CPU (gloo) and GPU alike.

Every parameter is then a ``DTensor`` holding this process's shard: the gradients are
reduce-scattered by FSDP during the backward pass, the optimizer keeps sharded moments, and a
checkpoint is gathered to one safetensors file on the main process (``full_state``) and split
again on load (``load_full_state``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from forgetless.errors import CheckpointError, ConfigError

FSDP_FLAG, VERSION_FLAG = "ACCELERATE_USE_FSDP", "FSDP_VERSION"


def truthy(value: str) -> bool:
    """An environment flag as accelerate writes it ("true", "1", "yes")."""
    return value.strip().lower() in ("1", "true", "yes")


def fsdp_launch() -> int | None:
    """The FSDP version ``accelerate launch`` asked for (None: not a sharded launch)."""
    if not truthy(os.environ.get(FSDP_FLAG, "")):
        return None
    return int(os.environ.get(VERSION_FLAG, "1") or "1")


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or a module inside it (a PEFT wrapper's model) is split by FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _block_classes(model: nn.Module) -> set[str]:
    named = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    found = {n.strip() for n in named.split(",") if n.strip()}
    return found or set(getattr(model, "_no_split_modules", None) or [])


def shard_model(model: nn.Module) -> nn.Module:
    """Shard ``model`` in place over every process (one ``fully_shard`` unit per block, then
    the root), as accelerate's FSDP2 plugin does; parameters become ``DTensor`` shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    classes = _block_classes(model)
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    if not blocks:
        raise ConfigError(
            f"FSDP: {type(model).__name__} names no transformer block class to shard by "
            "(set fsdp_transformer_layer_cls_to_wrap in the accelerate config)"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    reshard = truthy(os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true"))
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if hasattr(model, "generate"):  # a PeftModel's generate reaches the inner model's forward,
        register_fsdp_forward_method(model, "generate")  # past the root's gathering hook
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of ``tensor`` (the tensor itself when it is not a ``DTensor``)."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def copy_shards(source: nn.Module, target: nn.Module) -> None:
    """Each process copies its own shards of ``source``'s weights and buffers into ``target``,
    a model of the same architecture split the same way (no collective): a sharded deepcopy."""
    from torch.distributed.fsdp import FSDPModule

    for module in source.modules():  # a forward without reshard_after_forward leaves them whole
        if isinstance(module, FSDPModule):
            module.reshard()
    with torch.no_grad():
        pairs = [
            *zip(source.parameters(), target.parameters(), strict=True),
            *zip(source.buffers(), target.buffers(), strict=True),
        ]
        for mine, theirs in pairs:
            if local(mine).shape != local(theirs).shape:
                raise CheckpointError(
                    f"copy_shards: a shard of shape {tuple(local(mine).shape)} against "
                    f"{tuple(local(theirs).shape)}: the two models are not split alike"
                )
            local(theirs).copy_(local(mine))


def all_true(flag: bool) -> bool:
    """``flag`` on every process (a collective: every process must call it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() > 0)


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """State-dict names that are one tensor (tied embeddings), each group in its order."""
    by_storage: dict[int, list[str]] = {}
    for name, value in model.state_dict().items():
        key = local(value).untyped_storage().data_ptr()
        by_storage.setdefault(key, []).append(name)
    return [names for names in by_storage.values() if len(names) > 1]


def full_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on the main process, on CPU, a tied tensor once (every
    process must call it; the others get None)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state: dict[str, Any] = get_model_state_dict(model, options=options)
    if dist.get_rank() != 0:
        return None
    for names in _tied_groups(model):
        for name in sorted(names)[1:]:  # the name safetensors' save_model keeps: the first
            state.pop(name, None)
    return {k: v.contiguous() for k, v in state.items()}


def load_full_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Split the whole-model weights ``state`` (read by every process) into ``model``'s
    shards; a tied tensor may appear under any one of its names."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for names in _tied_groups(model):
        present = [n for n in names if n in state]
        for name in names:
            if present and name not in state:
                state[name] = state[present[0]]
    current = model.state_dict()
    missing = sorted(set(current) - set(state))
    if missing:
        raise CheckpointError(f"{where}: the checkpoint lacks {', '.join(missing[:3])}")
    with torch.no_grad():
        for name, value in current.items():
            full = state[name].to(value.dtype)
            if tuple(full.shape) != tuple(value.shape):
                raise CheckpointError(
                    f"{where}: {name} has shape {tuple(full.shape)}, the model {tuple(value.shape)}"
                )
            if isinstance(value, DTensor):
                part = distribute_tensor(
                    full, value.device_mesh, value.placements, src_data_rank=None
                )
                value.to_local().copy_(part.to_local())
            else:
                value.copy_(full)


def replicated(value: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` made whole on every process (a collective); other tensors as they are.
    Gradients flow back to each process's shard."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def gather_state(state: Any) -> Any:
    """A method's state with every ``DTensor`` gathered whole (every process must call it):
    what is saved is what a one-process run saves."""
    if isinstance(state, dict):
        return {k: gather_state(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return replicated(state).detach()
    return state


def split_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A whole tensor of ``param``'s shape, held alike on every process, split like ``param``
    when it is a ``DTensor`` (each process keeps its own part; no collective); else as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor) or tuple(value.shape) != tuple(param.shape):
        return value
    return distribute_tensor(
        value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
    )


def shard_state_like(state: Any, model: nn.Module) -> Any:
    """A saved method state with each tensor stored under a parameter's name (and of its shape)
    split like that parameter, so element-wise state stays beside its shard on resume."""
    params = dict(model.named_parameters())

    def split(value: Any, key: str | None) -> Any:
        if isinstance(value, dict):
            return {k: split(v, k) for k, v in value.items()}
        param = params.get(key) if key is not None else None
        if not isinstance(value, torch.Tensor) or param is None:
            return value
        return split_like(value, param)

    return split(state, None)
