"""The real track's budget choices, timed side by side on SmolLM2-135M-Instruct.

* a LoRA training step (r 8, top 8 layers, batch 8 of ``it-json``): logits over every position
  against logits over the completion window only, and float32 against bfloat16 autocast;
* multiple-choice scoring of the question set: every (question, choice) pair run in full with
  the vocabulary's log-softmax at every position, against the prompt run once with its cache and
  logits only where a choice token is predicted (what ``forgetless.eval.scorers`` does).

Each case is timed ``--repeats`` times, alternating, and reported as the median and the spread
(min, max) of the ratio over repeats. Needs the model (``make smollm2``).

    python studies/real_speedups.py [--repeats 3]
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
from forgetless.core.storage import atomic_write_json
from forgetless.engine.loop import causal_lm_loss
from forgetless.eval.scorers import choice_loglikelihoods
from forgetless.models.finetuner import Finetuner
from forgetless.models.loading import load_model_and_tokenizer
from forgetless.tasks.base import Example
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import (
    collate,
    completion_window,
    encode_prompt,
    encode_training_set,
)

OUT = Path(__file__).parent / "results" / "real_speedups.json"


def _step_case(
    model: Any, batch: dict[str, torch.Tensor], window: bool, bf16: bool
) -> Callable[[], None]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)

    def step() -> None:
        extra = {"logits_to_keep": completion_window(batch["labels"])} if window else {}
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            out = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra
            )
        loss = causal_lm_loss(out.logits, batch["labels"][:, -out.logits.shape[1] :])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


@torch.no_grad()
def _pairs_in_full(model: Any, tokenizer: Any, examples: list[Example]) -> list[list[float]]:
    """The straightforward scorer: each (prompt, choice) in full, log-softmax everywhere."""
    scores = []
    for ex in examples:
        prompt = encode_prompt(tokenizer, ex)
        row = []
        for choice in ex.choices or ():
            ids = tokenizer(choice, add_special_tokens=False)["input_ids"]
            logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + ids])).logits[0], -1)
            row.append(sum(float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(ids)))
        scores.append(row)
    return scores


def _timed(case: Callable[[], Any]) -> float:
    start = time.perf_counter()
    case()
    return time.perf_counter() - start


def _compare(cases: dict[str, Callable[[], Any]], repeats: int, reference: str) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            times[name].append(_timed(case))
    out: dict[str, Any] = {}
    for name, values in times.items():
        ratios = [r / v for r, v in zip(times[reference], values, strict=True)]
        out[name] = {
            "median_seconds": statistics.median(values),
            "speedup_vs_reference": statistics.median(ratios),
            "speedup_spread": [min(ratios), max(ratios)],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    cfg = validate_config(smollm2_config_dict())
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    questions = build_builtin_task("gk-mc", 0, args.questions, 0).eval
    model.eval()
    fast = choice_loglikelihoods(model, tokenizer, questions, 32)
    slow = _pairs_in_full(model, tokenizer, questions)
    gap = max(
        abs(a - b) for fr, sr in zip(fast, slow, strict=True) for a, b in zip(fr, sr, strict=True)
    )
    scoring = _compare(
        {
            "pairs_in_full": lambda: _pairs_in_full(model, tokenizer, questions),
            "prompt_once": lambda: choice_loglikelihoods(model, tokenizer, questions, 32),
        },
        args.repeats,
        "pairs_in_full",
    )
    finetuner = Finetuner(model, cfg.finetune)
    finetuner.begin_task(1)
    task = build_builtin_task("it-json", 64, 1, 0)
    features, _ = encode_training_set(tokenizer, task.train, cfg.train.max_length, "it-json")
    batch = collate(features[:8], tokenizer.pad_token_id)
    lora = finetuner.model
    lora.train()
    steps = _compare(
        {
            "all_positions_fp32": _step_case(lora, batch, window=False, bf16=False),
            "window_fp32": _step_case(lora, batch, window=True, bf16=False),
            "window_bf16_autocast": _step_case(lora, batch, window=True, bf16=True),
        },
        args.repeats,
        "all_positions_fp32",
    )
    report = {
        "training_step": steps,
        "choice_scoring": {**scoring, "questions": args.questions, "max_abs_gap_nats": gap},
        "commit": commit(),
        "machine": machine(torch.get_num_threads()),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    atomic_write_json(args.out, report)
    for name, row in {**steps, **scoring}.items():
        print(f"{name}: {row['median_seconds']:.2f} s, x{row['speedup_vs_reference']:.2f}")


if __name__ == "__main__":
    main()
