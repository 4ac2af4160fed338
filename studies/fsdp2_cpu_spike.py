"""Can 2 CPU processes (gloo) shard a model with torch's FSDP2 (``fully_shard``) and take the
step one process takes? accelerate 1.16 takes FSDP only on GPU-family devices, so this is the
CPU path issue 22 would use (docs/scale-out.md).

    python studies/fsdp2_cpu_spike.py        # prints the largest weight difference
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def worker(rank: int, world: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29651")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    m = model()
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    m.set_gradient_divide_factor(1.0)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    x, y = data()
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    loss = ((m(xs) - ys) ** 2).sum() / x.numel()
    loss.backward()
    opt.step()
    full = {k: v.full_tensor() for k, v in m.state_dict().items()}
    if rank == 0:
        local = tuple(m[0].weight.to_local().shape)
        print(f"sharded: {type(m[0].weight).__name__}, local shard {local} of (16, 8)")
        save_file({k: v.contiguous() for k, v in full.items()}, out)
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "two.safetensors")
        mp.spawn(worker, args=(2, out), nprocs=2)
        two = load_file(out)
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    x, y = data()
    (((m(x) - y) ** 2).sum() / x.numel()).backward()
    opt.step()
    diff = max(float((two[k] - v).abs().max()) for k, v in m.state_dict().items())
    print(f"largest weight difference after one AdamW step, 2 sharded processes vs 1: {diff:.2e}")


if __name__ == "__main__":
    main()
