"""What DeepSpeed ZeRO-1/2 splits, counted: the optimizer's tensors on each of 2 CPU processes.

One AdamW step of the tiny model through the engine forgetless trains with
(``distributed.zero_engine``), on 2 processes started with the environment ``accelerate launch
--use_deepspeed`` sets, against the same step of a plain AdamW on one process. Counted per
process, in elements: the two AdamW moments and the engine's float32 master copy of the
partition. The memory model (``memory_model.py``, docs/scale-out.md) assumes ZeRO-1/2 divide
the master copy and the moments by the number of processes; this checks it on the real engine.

    make deepspeed
    python studies/zero_memory.py          # -> results/zero_memory.json
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
import torch
import torch.multiprocessing as mp
from run_all import commit, machine

from forgetless.config.schema import TinyModelConfig
from forgetless.core import distributed, zero
from forgetless.core.storage import atomic_write_json
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model

OUT = Path(__file__).parent / "results" / "zero_memory.json"
TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64
)


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_tiny_model(TINY, len(build_char_tokenizer()), seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, backward: Any) -> None:
    tokens = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    backward(model(input_ids=tokens, labels=tokens).loss)


def _moments(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() for state in optimizer.state.values() for t in state.values() if t.dim() > 0
    )


def _worker(rank: int, stage: int, port: int, out: str) -> None:
    os.environ.update(zero.launch_env(rank, 2, port, stage))
    distributed.start()
    model, optimizer = _model_and_optimizer()
    with distributed.zero_engine(model, optimizer, 8, 1.0) as engine:
        assert engine is not None
        _step(engine.module, lambda loss: engine.backward(loss, last=True))
        engine.step()
        master = sum(t.numel() for t in engine.engine.optimizer.single_partition_of_fp32_groups)
        record = {"moments": _moments(optimizer), "master": master}
    Path(out, f"{stage}-{rank}.json").write_text(json.dumps(record), encoding="utf-8")


def main() -> None:
    model, optimizer = _model_and_optimizer()
    _step(model, lambda loss: loss.backward())
    optimizer.step()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report: dict[str, Any] = {
        "commit": commit(),
        "machine": machine(torch.get_num_threads()),
        "trainable": trainable,
        "single": {"moments": _moments(optimizer), "master": 0},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for stage in (1, 2):
            port = 29700 + os.getpid() % 200 + stage
            mp.spawn(_worker, args=(stage, port, scratch), nprocs=2)
            report[f"zero{stage}"] = [
                json.loads(Path(scratch, f"{stage}-{rank}.json").read_text()) for rank in (0, 1)
            ]
    atomic_write_json(OUT, report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
