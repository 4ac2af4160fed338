"""Anchored Learning's anchor pass on the completion window, against the full forward, on
SmolLM2-135M.

Each of Anchored Learning's T iterations forms its anchor from the student's and the SFT
reference's log-probabilities at every completion position of the task's examples (and measures
the bound and the step with them). That pass took 42% of an `anchored` task's time in the real
campaign (``cost.cache_seconds`` in its records). The reference runs each batch in full with
logits at every position, as the pass did before; ``forgetless.methods.anchored
.completion_logprobs`` now runs the tokens every row shares once and asks only for the trailing
positions that hold the completions. The case is one batch of the preset's batch size from
the first task's training examples; the cases alternate over ``--repeats``; the report has the
median time of each, the median and spread (min, max) of the ratio, and the largest gap
between the two over every vocabulary entry at every completion position. Needs the model
(``make smollm2``).

    python studies/anchored_window.py [--repeats 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from forced_window import compare_and_write, preset_model  # studies/ is on sys.path

from forgetless.methods.anchored import completion_logprobs, completion_mask
from forgetless.tasks.formatting import collate, encode_example
from forgetless.training.runner import load_tasks

OUT = Path(__file__).parent / "results" / "anchored_window.json"


@torch.no_grad()
def every_position(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The pass before: logits at every position, the completion positions' log-softmax."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.log_softmax(logits[:, :-1][completion_mask(batch)].float(), dim=-1)


@torch.no_grad()
def windowed(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return completion_logprobs(model, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    cfg, lm, tokenizer = preset_model()
    task = load_tasks(cfg.tasks[:1], cfg)[0]
    examples = task.train[: cfg.train.batch_size * 4]
    feats = [encode_example(tokenizer, e, cfg.train.max_length) for e in examples]
    batches = [
        collate(feats[lo : lo + cfg.train.batch_size], tokenizer.pad_token_id)
        for lo in range(0, len(feats), cfg.train.batch_size)
    ]
    info = {
        "case": f"anchor pass, {len(feats)} training examples of {task.name} "
        f"in batches of {cfg.train.batch_size}"
    }
    compare_and_write(args.out, info, lm, batches, every_position, windowed, args.repeats)


if __name__ == "__main__":
    main()
