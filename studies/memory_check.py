"""The memory model's per-parameter accounting, checked against the tensors a method really keeps.

For each method of ``memory_model.METHODS`` and each fine-tuning mode it supports, on the demo's
tiny model (``method_harness``: one past task builds the method's state, then the next task's
steps run), every tensor alive at each optimizer step (before and after it, when the backward
pass has freed its activations) is counted: the storages reachable from Python, each once, and
the gradients of the tensors found. The largest count over the task, less ``seq_ft``'s in the
same mode, is what the method keeps beyond the model and AdamW. Divided by the trainable weights
(and by all weights, for a frozen reference), it gives how many parameter-sized tensors the
method holds, which the model predicts (``trainable_widths``, ``weight_widths``). Widths differ
on purpose: this run is float32 on the CPU where the model assumes bf16 mixed precision, so
elements are compared, and bytes are reported beside them.

    python studies/memory_check.py [--methods ewc,kl_sft]   # -> results/memory_check.json
"""

from __future__ import annotations

import argparse
import gc
import shutil
import warnings
from pathlib import Path
from typing import Any

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
import torch
from memory_model import METHODS, predicted_copies
from method_harness import Bench, add_harness_args, supports
from peak_memory import add_step_args, run_forked
from run_all import commit, machine
from torch.optim import optimizer as hooks

from forgetless.contract.method import registered_methods, trainable_parameters
from forgetless.core.storage import atomic_write_json

OUT = Path(__file__).parent / "results" / "memory_check.json"


def live_tensors() -> tuple[int, int]:
    """Elements and bytes of every tensor storage reachable from Python, each storage once."""
    storages: dict[int, tuple[int, int]] = {}
    with warnings.catch_warnings():  # isinstance wakes deprecated module attributes up
        warnings.simplefilter("ignore")
        found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    found += [o.grad for o in found if o.is_leaf and o.grad is not None]
    for tensor in found:
        storage = tensor.untyped_storage()
        if storage.data_ptr():
            width = tensor.element_size()
            storages[storage.data_ptr()] = (storage.nbytes() // width, storage.nbytes())
    return sum(e for e, _ in storages.values()), sum(b for _, b in storages.values())


class PeakCounter:
    """The largest ``live_tensors`` count at any optimizer step while open."""

    def __init__(self) -> None:
        self.elements = self.bytes = 0
        self.handles = [
            hooks.register_optimizer_step_pre_hook(self._count),
            hooks.register_optimizer_step_post_hook(self._count),
        ]

    def _count(self, *_: Any) -> None:
        elements, nbytes = live_tensors()
        self.elements, self.bytes = max(self.elements, elements), max(self.bytes, nbytes)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def count(name: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One method's peak live tensors over its second task, with the model's sizes."""
    bench = Bench(name, mode, args)
    try:
        bench.past_task()
        counter = PeakCounter()
        try:
            bench.timed_task()
        finally:
            counter.close()
    finally:
        shutil.rmtree(bench.work, ignore_errors=True)
    model = bench.finetuner.model
    trainable = sum(p.numel() for p in trainable_parameters(model).values())
    every = sum(p.numel() for p in model.parameters())
    return {
        "elements": counter.elements,
        "bytes": counter.bytes,
        "trainable": trainable,
        "weights": every - trainable if mode == "lora" else every,  # the base model's
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_args(parser, OUT)
    add_harness_args(parser)
    parser.add_argument("--methods", default="all", help="comma-separated, or all")
    parser.set_defaults(steps=4, warmup=1, n_train=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads or 1)
    wanted = list(METHODS) if args.methods == "all" else args.methods.split(",")
    names = [n for n in wanted if n in registered_methods()]
    rows = []
    for mode in ("full", "lora"):
        base = run_forked(count, "seq_ft", mode, args)
        for name in names:
            if not supports(name, mode):
                continue
            row = base if name == "seq_ft" else run_forked(count, name, mode, args)
            extra = (row["elements"] - base["elements"]) / row["trainable"]
            predicted = predicted_copies(name, row | {"mode": mode})
            rows.append(
                {
                    "method": name,
                    "mode": mode,
                    "measured_copies": round(extra, 3),
                    "extra_bytes_per_trainable": round(
                        (row["bytes"] - base["bytes"]) / row["trainable"], 2
                    ),
                    **row,
                }
            )
            print(f"{name:18s} {mode:4s} measured {extra:7.3f}  model {predicted:7.3f}", flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    report = {"settings": settings, "rows": rows, "commit": commit(), "machine": machine(1)}
    atomic_write_json(args.out, report)


if __name__ == "__main__":
    main()
