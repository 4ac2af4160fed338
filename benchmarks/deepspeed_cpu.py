"""Whether accelerate reaches DeepSpeed ZeRO on CPU processes: one AdamW step of a small MLP
through ``accelerator.prepare`` with a ZeRO stage, printed per process (docs/scale-out.md).

DeepSpeed is not a dependency of forgetless; install it apart (no compiled ops) and launch:

    DS_BUILD_OPS=0 pip install --no-build-isolation --no-deps --target /tmp/dslib \\
        deepspeed==0.19.8 \\
        hjson py-cpuinfo msgpack ninja einops
    DS_ACCELERATOR=cpu PYTHONPATH=/tmp/dslib STAGE=3 \\
        accelerate launch --num_processes 2 --use_deepspeed benchmarks/deepspeed_cpu.py
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin


def main() -> None:
    stage = int(os.environ.get("STAGE", "2"))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
    }
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), cpu=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    weight = model.module[0].weight
    held = weight.ds_tensor.numel() if hasattr(weight, "ds_tensor") else weight.numel()
    loss = model(torch.randn(4, 8)).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    print(
        f"rank {accelerator.process_index} of {accelerator.num_processes} "
        f"(torch.distributed: {dist.get_rank()} of {dist.get_world_size()}, {dist.get_backend()}): "
        f"{accelerator.distributed_type}, ZeRO-{stage}, "
        f"{type(model).__name__} + {type(optimizer).__name__}, holds {held} of the first "
        f"layer's {8 * 16} weights, one step, loss {loss.item():.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
