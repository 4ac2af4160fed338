"""Teacher-forced measures on a shared prefix and the completion window, against one forward of
the batch with logits at every position, on SmolLM2-135M.

The case is the real track's KL budget check (``configs/real-budget.yaml``): a probe batch of 32
held-out examples, the log-softmax of the vocabulary at each completion position. The reference
runs the batch in full and asks for logits at every position; ``forgetless.eval.generation``
runs the tokens every row starts with once (each row continues from a copy of that key/value
cache) and asks only for the trailing positions that hold the completions (``logits_to_keep``),
so the 49,152-word output layer and its log-softmax skip the prompt. The largest gap between the
two on the completion tokens' log-probabilities is reported. The cases alternate over
``--repeats``; the report has the median time of each and the median and spread (min, max) of
the ratio. Needs the model (``make smollm2``).

    python studies/forced_window.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
import torch
from run_all import commit, machine

from forgetless.config.loading import validate_config
from forgetless.config.presets import smollm2_config_dict
from forgetless.config.schema import RunConfig
from forgetless.core.storage import atomic_write_json
from forgetless.eval.generation import forced_logprobs, teacher_forced_inputs
from forgetless.models.loading import load_model_and_tokenizer
from forgetless.tasks.formatting import IGNORE_INDEX
from forgetless.training.budget_probe import probe_batch
from forgetless.training.runner import load_tasks

OUT = Path(__file__).parent / "results" / "forced_window.json"


@torch.no_grad()
def every_position(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference: logits and log-softmax at every position; the completion tokens' values."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    labels = inputs["labels"][:, 1:]
    return logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[labels != IGNORE_INDEX]


def windowed(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the budget's check computes; the completion tokens' values."""
    logp, mask = forced_logprobs(model, inputs)
    labels = inputs["labels"][:, 1:][:, -logp.shape[1] :]
    return logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask]


def compare_and_write(
    out: Path,
    info: dict[str, Any],
    lm: Any,
    inputs: list[Any],
    every: Callable[[Any, Any], torch.Tensor],
    window: Callable[[Any, Any], torch.Tensor],
    repeats: int,
) -> None:
    """``every(lm, x)`` against ``window(lm, x)`` over ``inputs``: the largest gap between their
    values, and their times over ``repeats`` with the order reversed every other repeat (each
    case's seconds and median; the window's time as a ratio of the full forward's, median and
    spread). Written to ``out`` with ``info``, the commit and the machine."""
    gap = max(float((every(lm, x) - window(lm, x)).abs().max()) for x in inputs)
    cases = {"every_position": every, "window": window}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(repeats):
        for name in list(cases) if repeat % 2 == 0 else list(reversed(cases)):
            start = time.perf_counter()
            for x in inputs:
                cases[name](lm, x)
            times[name].append(time.perf_counter() - start)
    ratios = [w / e for w, e in zip(times["window"], times["every_position"], strict=True)]
    report = {
        **info,
        "median_seconds": {name: statistics.median(v) for name, v in times.items()},
        "seconds": times,
        "time_ratio_window": statistics.median(ratios),
        "time_ratio_spread": [min(ratios), max(ratios)],
        "max_abs_gap_nats": gap,
        "commit": commit(),
        "machine": machine(torch.get_num_threads()),
    }
    atomic_write_json(out, report)
    print(f"window / every position: x{report['time_ratio_window']:.2f}, gap {gap:.1e} nats")


def preset_model() -> tuple[RunConfig, Any, Any]:
    """The real track's preset, and its model (in eval mode) and tokenizer."""
    cfg = validate_config(smollm2_config_dict())
    lm, tokenizer = load_model_and_tokenizer(cfg.model)
    return cfg, lm.eval(), tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probe-batch", type=int, default=32)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    cfg, lm, tokenizer = preset_model()
    batch = probe_batch(load_tasks(cfg.probes, cfg), args.probe_batch)
    inputs = [teacher_forced_inputs(tokenizer, p.eval, cfg.train.max_length) for p in batch]
    info = {
        "case": f"KL budget check, {sum(len(p.eval) for p in batch)} probe examples",
        "probes": [p.name for p in batch],
    }
    compare_and_write(args.out, info, lm, inputs, every_position, windowed, args.repeats)


if __name__ == "__main__":
    main()
