"""First-order head effects against exact patching on the real model, over sampled layers.

    python studies/circuits_agreement.py [--model smollm2-135m-instruct] [--layers 0,10,20,29]

`diagnose circuits --effects attribution` reads every head's necessity and sufficiency from two
backward passes. Here the same heads are also patched one at a time (the exact effects, two
masked forwards per head) on the base model and the question set's free answers, and the two
are compared by rank (Spearman) and by value (Pearson), with the top heads' overlap. Writes
``studies/results/circuits_agreement.json`` with the commit and the machine.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
import torch
from run_all import commit, machine

from forgetless.core.storage import atomic_write_json
from forgetless.diagnostics.circuits import (
    Batch,
    Counterfactual,
    counterfactual,
    head_effects_attribution,
    head_layout,
    masked_logits,
    target_logprob,
)
from forgetless.diagnostics.diagnose_circuits import (
    behaviour_task,
    encode_behaviour,
    load_checkpoint,
)

OUT = Path(__file__).parent / "results" / "circuits_agreement.json"


def behaviour_under(
    model: Any, batch: Batch, masks: torch.Tensor, cf: Counterfactual
) -> torch.Tensor:
    """The behaviour m under each of ``masks`` (one forward pass per mask)."""
    with torch.no_grad():
        return torch.stack(
            [
                target_logprob(masked_logits(model, batch, m, cf), batch["labels"]).mean()
                for m in masks
            ]
        )


def exact_effects(
    model: Any, batch: Batch, cf: Counterfactual, heads: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Necessity and sufficiency of ``heads``, each patched (or kept) alone."""
    layout = head_layout(model)
    ones = torch.ones(layout.layers, layout.heads)
    alone_patched, alone_clean = [], []
    for layer, head in heads:
        patched, clean = ones.clone(), torch.zeros_like(ones)
        patched[layer, head], clean[layer, head] = 0.0, 1.0
        alone_patched.append(patched)
        alone_clean.append(clean)
    base = behaviour_under(model, batch, torch.stack([ones, torch.zeros_like(ones)]), cf)
    necessity = base[0] - behaviour_under(model, batch, torch.stack(alone_patched), cf)
    sufficiency = behaviour_under(model, batch, torch.stack(alone_clean), cf) - base[1]
    return necessity, sufficiency


def agreement(first: torch.Tensor, exact: torch.Tensor, top: int) -> dict[str, float]:
    ranks = torch.stack([t.argsort().argsort().float() for t in (first, exact)])
    top_first = set(first.argsort(descending=True)[:top].tolist())
    top_exact = set(exact.argsort(descending=True)[:top].tolist())
    return {
        "spearman": float(torch.corrcoef(ranks)[0, 1]),
        "pearson": float(torch.corrcoef(torch.stack([first, exact]))[0, 1]),
        f"top{top}_overlap": len(top_first & top_exact) / top,
        "exact_max": float(exact.max()),
        "first_order_max": float(first.max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--layers", default="0,10,20,29")
    parser.add_argument("--n", type=int, default=16)
    args = parser.parse_args()
    model, tokenizer = load_checkpoint(Path(args.model))
    task, corrupt = behaviour_task("gk-short", args.n, 0)
    batch, _ = encode_behaviour(tokenizer, task.eval, corrupt, 64)
    cf = counterfactual(model, batch, "mean")
    layout = head_layout(model)
    heads = [(int(ly), h) for ly in args.layers.split(",") for h in range(layout.heads)]
    start = time.perf_counter()
    first = head_effects_attribution(model, batch, cf)
    first_seconds = time.perf_counter() - start
    start = time.perf_counter()
    necessity, sufficiency = exact_effects(model, batch, cf, heads)
    exact_seconds = time.perf_counter() - start
    index = torch.tensor([ly * layout.heads + h for ly, h in heads])
    report = {
        "model": args.model,
        "behaviour": task.name,
        "examples": args.n,
        "heads": [list(h) for h in heads],
        "necessity": agreement(first.necessity.flatten()[index], necessity, 5),
        "sufficiency": agreement(first.sufficiency.flatten()[index], sufficiency, 5),
        "seconds": {
            "first_order_all_heads": round(first_seconds, 1),
            "exact_sampled_heads": round(exact_seconds, 1),
        },
        "commit": commit(),
        "machine": machine(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))),
        "load_before": round(os.getloadavg()[0], 2),
    }
    atomic_write_json(OUT, report)
    print({k: report[k] for k in ("necessity", "sufficiency", "seconds")})


if __name__ == "__main__":
    main()
