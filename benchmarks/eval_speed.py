"""A real-track evaluation row with the prompts' shared head run once, against the same row with
every prompt run whole, side by side on SmolLM2-135M-Instruct.

The row is the one ``forgetless run --preset smollm2`` scores after its last task: four tasks of
48 greedy generations, ``gk-mc`` (320 questions by choice log-likelihood), ``gk-short`` (96),
``chat-format`` (32), the gold log-likelihoods, the KL to the base and the prose. ``shared`` is
forgetless as it is (``forgetless.eval.prompt_batch``: the chat template's system turn, 24 tokens
of about 50, runs once per batch; choice continuations run grouped by length); ``plain`` puts
the library's earlier layout back in this process (each prompt left-padded whole, every choice
continuation padded to the longest). The arms alternate over ``--repeats``; each ratio is
``plain ÷ shared`` within a repeat. Both arms must give the same row: their accuracies are
compared and reported. Each repeat also scores a row between tasks (``eval.between``), and the
report keeps where both rows' time goes (``EvalRow.parts``, the shared arm's median per part).
Needs the model (``make smollm2``).

    python benchmarks/eval_speed.py [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from run_all import commit, load_words, machine, machine_words  # benchmarks/ is on sys.path

from forgetless.config.loading import validate_config
from forgetless.config.presets import smollm2_config_dict
from forgetless.config.schema import TaskConfig
from forgetless.core.storage import atomic_write_json
from forgetless.eval import prompt_batch, scorers
from forgetless.eval.evaluator import EvalRow, Evaluator
from forgetless.models.loading import load_model_and_tokenizer, resolve_source
from forgetless.training.task_data import load_tasks

OUT = Path(__file__).parent / "results" / "eval_speed.json"


def _one_padded_group(pairs: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The earlier layout: every pair in one continuation batch, padded to the longest."""
    longest = max(len(choice) for _, choice in pairs) - 1
    return [(longest, list(range(len(pairs))))] if longest > 0 else []


def _padded_continuations(
    model: Any, cache: Any, mask: torch.Tensor, pairs: list[tuple[int, list[int]]], rest: int
) -> list[float]:
    """The earlier ``scorers._continuations``: every choice right-padded to ``rest`` tokens."""
    rows = torch.tensor([row for row, _ in pairs])
    cache.batch_select_indices(rows)
    ids = torch.zeros((len(pairs), rest), dtype=torch.long)
    own = torch.zeros((len(pairs), rest), dtype=torch.long)
    for index, (_, choice) in enumerate(pairs):
        ids[index, : len(choice) - 1] = torch.tensor(choice[:-1])
        own[index, : len(choice) - 1] = 1
    positions = mask[rows].sum(-1, keepdim=True) + torch.arange(rest)
    logits = model(
        input_ids=ids,
        attention_mask=torch.cat([mask[rows], own], dim=1),
        position_ids=positions,
        use_cache=True,
        **{scorers.cache_keyword(model): cache},
    ).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [
        float(
            logp[index, torch.arange(len(choice) - 1), torch.tensor(choice[1:], dtype=torch.long)]
            .double()
            .sum()
        )
        for index, (_, choice) in enumerate(pairs)
    ]


@contextmanager
def plain_layout() -> Iterator[None]:
    """No shared head and padded continuations, for the duration."""
    head = prompt_batch.shared_head
    groups, continuations = scorers._by_continuation_length, scorers._continuations
    prompt_batch.shared_head = lambda prompts: 0  # type: ignore[assignment]
    scorers._by_continuation_length = _one_padded_group  # type: ignore[assignment]
    scorers._continuations = _padded_continuations  # type: ignore[assignment]
    try:
        yield
    finally:
        prompt_batch.shared_head = head
        scorers._by_continuation_length, scorers._continuations = groups, continuations


def _evaluator() -> tuple[Evaluator, Any]:
    cfg = validate_config(smollm2_config_dict())
    quiet = lambda *args, **kwargs: None  # noqa: E731
    tasks = load_tasks(cfg.tasks, cfg, quiet)
    probes = load_tasks([p for p in cfg.probes if isinstance(p, TaskConfig)], cfg, quiet, True)
    source = resolve_source(str(cfg.model.name_or_path), quiet)
    model, tokenizer = load_model_and_tokenizer(cfg.model, source)
    evaluator = Evaluator.for_run(cfg, tasks, probes, tokenizer)
    evaluator.measure_base(model)
    return evaluator, model


def _timed(evaluator: Evaluator, model: Any, arm: str) -> tuple[float, EvalRow]:
    start = time.perf_counter()
    if arm == "plain":
        with plain_layout():
            row = evaluator.score(model)
    else:
        row = evaluator.score(model)
    return time.perf_counter() - start, row


def _median_parts(rows: list[EvalRow]) -> dict[str, float]:
    return {name: statistics.median(row.parts[name] for row in rows) for name in rows[0].parts}


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "range": [min(values), max(values)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = os.getloadavg()[0]
    evaluator, model = _evaluator()
    seconds: dict[str, list[float]] = {"shared": [], "plain": []}
    rows: dict[str, list[EvalRow]] = {"shared": [], "plain": [], "between": []}
    for repeat in range(args.repeats):
        for arm in ("shared", "plain") if repeat % 2 == 0 else ("plain", "shared"):
            took, row = _timed(evaluator, model, arm)
            seconds[arm].append(took)
            rows[arm].append(row)
            print(f"repeat {repeat + 1}, {arm}: {took:.1f} s", flush=True)
        rows["between"].append(evaluator.score(model, between=True))
    ratios = [p / s for p, s in zip(seconds["plain"], seconds["shared"], strict=True)]
    report = {
        "settings": vars(args) | {"out": str(args.out)},
        "machine": machine(args.threads),
        "commit": commit(),
        "load": {"before": before, "after": os.getloadavg()[0]},
        "seconds": {arm: _spread(v) for arm, v in seconds.items()},
        "plain_over_shared": _spread(ratios),
        "same_row": rows["shared"][-1].accuracy == rows["plain"][-1].accuracy,
        "accuracy": rows["shared"][-1].accuracy,
        "runs": seconds,
        "parts": {
            "full": _median_parts(rows["shared"]),
            "between": _median_parts(rows["between"]),
        },
    }
    atomic_write_json(args.out, report)
    print(render_table(report))


def render_table(report: dict[str, Any]) -> str:
    """The tables docs/performance.md quotes (the layouts, then the parts), and where."""
    secs, ratio = report["seconds"], report["plain_over_shared"]

    def cell(spread: dict[str, Any]) -> str:
        low, high = spread["range"]
        return f"{spread['median']:.1f} [{low:.1f}–{high:.1f}]"

    s = report["settings"]
    return "\n".join(
        [
            "| layout | one full row, s |",
            "|---|---|",
            f"| shared head, continuations by length (forgetless) | {cell(secs['shared'])} |",
            f"| every prompt whole, continuations padded (before) | {cell(secs['plain'])} |",
            "",
            f"plain ÷ shared: {ratio['median']:.2f} [{ratio['range'][0]:.2f}–"
            f"{ratio['range'][1]:.2f}]; the same row from both: "
            f"{'yes' if report['same_row'] else 'no'}. {s['repeats']} alternating repeats on "
            f"{machine_words(report['machine'])}, commit `{report['commit'][:7]}`, "
            f"{load_words(report['load'])}.",
        ]
    ) + (f"\n\n{render_parts(report)}" if "parts" in report else "")


PART_GROUPS = {
    "greedy decoding: gk-short and chat-format": ("gk-short", "chat-format"),
    "gk-mc: choices by log-likelihood": ("gk-mc",),
    "gold log-likelihoods (tasks and probes)": ("loglik",),
    "KL to the base on the probes": ("kl_drift",),
    "held-out prose: perplexity and KL": ("prose",),
}


def render_parts(report: dict[str, Any]) -> str:
    """Where a full row's and a row between tasks' time goes, part by part (medians)."""
    parts = report["parts"]
    totals = {kind: sum(parts[kind].values()) for kind in ("full", "between")}
    named = {name for names in PART_GROUPS.values() for name in names}
    tasks = tuple(name for name in parts["full"] if name not in named)  # lm_eval: none here
    groups = {"greedy decoding: the run's four tasks": tasks, **PART_GROUPS}
    lines = ["| part | full row, s (share) | row between tasks, s (share) |", "|---|---|---|"]
    for label, names in groups.items():
        cells = []
        for kind in ("full", "between"):
            spent = sum(parts[kind].get(name, 0.0) for name in names)
            cells.append(f"{spent:.1f} ({spent / totals[kind]:.0%})")
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    lines.append(f"| all parts | {totals['full']:.1f} | {totals['between']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
