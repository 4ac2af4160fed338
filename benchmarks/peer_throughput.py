"""forgetless's step loop beside TRL's ``SFTTrainer`` and the plain transformers ``Trainer``, on
SmolLM2-135M-Instruct with LoRA: steps per second, time to the first step and peak memory.

One workload for all three (issue 50): the model converted once from its GGUF
(``make smollm2``) and loaded from that folder; LoRA r 8 (α 16) on every projection of layers
22–29; batches of 8 ``it-json`` examples whose chat-templated encoding is exactly ``--length``
tokens (61: no padding), tokenized once by forgetless and handed to every system as the same
ids, with the loss on the completion only; fused AdamW at a constant rate, gradient norm
clipped at 1. Each case runs in a fresh interpreter (``--case``), launched by this script, which
passes it the launch time: the time to the first step counts the imports, the model load, the
data and the trainer's setup. Cases alternate over ``--repeats`` (the order reversed every other
repeat); a case's step is the median of its timed steps (after ``--warmup``), every ratio is
taken within a repeat and reported as its median and range. ``forgetless:<method>`` runs a
method's step through the same loop (``kl_sft``'s reference is the adapter-free model).

The runner of ``forgetless run`` also scores the base model before the first task; that time is
evaluation, measured by the real-track runs (docs/performance.md), not here.

    python benchmarks/peer_throughput.py [--repeats 3] [--steps 25] [--threads 2]

Quick check: ``--repeats 1 --steps 2 --warmup 1 --out /tmp/peers.json``. Where a case's time
goes: ``--profile trainer --steps 5 --warmup 2`` (torch's operator table, in this process).
Needs TRL (``pip install -e ".[trl]"``) and the model (``make smollm2``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "peer_throughput.json"
CASES = ("forgetless", "trainer", "trl", "forgetless:kl_sft", "forgetless:sae_fd")
TASK = "it-json"
LAYERS = list(range(22, 30))
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 5e-4


def workload_config(args: argparse.Namespace) -> Any:
    """The real track's run config with this workload's LoRA, batch and length."""
    from forgetless.config.loading import validate_config
    from forgetless.config.presets import smollm2_config_dict

    raw = smollm2_config_dict()
    raw["finetune"]["lora"].update({"layers": LAYERS, "target_modules": PROJECTIONS})
    raw["train"].update({"batch_size": args.batch_size, "max_length": args.length, "lr": LR})
    return validate_config(raw)


def workload_features(tokenizer: Any, args: argparse.Namespace) -> list[dict[str, list[int]]]:
    """The task's training examples whose encoding is exactly ``args.length`` tokens."""
    from forgetless.tasks.builtin import build_builtin_task
    from forgetless.tasks.formatting import encode_example

    task = build_builtin_task(TASK, n_train=args.n_train, n_eval=1, seed=0)
    encoded = (encode_example(tokenizer, e, args.length + 1) for e in task.train)
    kept = [f for f in encoded if len(f["input_ids"]) == args.length]
    need = args.batch_size * (args.warmup + args.steps)
    if len(kept) < args.batch_size:
        raise SystemExit(f"--length {args.length}: only {len(kept)} {TASK} examples that long")
    return (kept * (need // len(kept) + 1))[:need]


def forgetless_case(method: str, args: argparse.Namespace, stamp: Callable[[], None]) -> float:
    """Runs the steps; returns the tokens a step trains on (a batch transform's rows counted)."""
    from forgetless.contract.hooks import RunInfo, TaskContext
    from forgetless.contract.method import create_method, method_class
    from forgetless.contract.plan import TrainPlan
    from forgetless.engine.session import TaskSession
    from forgetless.models.finetuner import Finetuner
    from forgetless.models.loading import load_model_and_tokenizer
    from forgetless.tasks.builtin import build_builtin_task

    cfg = workload_config(args)
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    finetuner = Finetuner(model, cfg.finetune)
    finetuner.begin_task(1)
    features = workload_features(tokenizer, args)
    work = Path(tempfile.mkdtemp(prefix="forgetless-peers-"))
    info = RunInfo(0, work, [TASK], [], "lora", max_length=args.length, lora_regime="carry")
    task = build_builtin_task(TASK, n_train=1, n_eval=1, seed=0)
    device = next(model.parameters()).device
    ctx = TaskContext(info, 1, task, finetuner.model, tokenizer, features, [], device, [task])
    config = method_class(method).config_cls.model_validate({})
    chosen = create_method(config)
    if method == "sae_fd":  # timed as on a second task: anchors of a first one, an SAE
        _as_on_a_second_task(chosen, ctx)
        ctx = dataclasses.replace(ctx, task_index=2)
    rows_seen: list[int] = []
    transform = chosen.transform_batch

    def counted(batch: list[dict[str, list[int]]], step: Any) -> list[dict[str, list[int]]]:
        out = transform(batch, step)
        rows_seen.append(sum(len(f["input_ids"]) for f in out))
        return out

    chosen.transform_batch = counted  # type: ignore[method-assign]
    session = TaskSession(chosen, ctx, tokenizer.pad_token_id, out_dir=work)
    plan = TrainPlan(steps=args.warmup + args.steps, batch_size=args.batch_size, lr=LR, seed=0)
    with session.started():
        loop = session.loop()
        loop.on_step = lambda name, terms: stamp()
        loop.run(features, plan)
    return statistics.mean(rows_seen) if rows_seen else float(args.batch_size * args.length)


def _as_on_a_second_task(method: Any, ctx: Any) -> None:
    """``sae_fd`` after a first task: its anchors captured from this workload's examples, and a
    randomly initialised gated SAE of the trained one's shape (its cost does not depend on its
    weights; ``benchmarks/sae_fd_overhead.py`` does the same)."""
    from forgetless.sae.gated import GatedSAE, GatedSAEConfig, freeze
    from forgetless.sae.train import input_scale

    method.capture_anchors(ctx)
    h = method.buffer.h.float()
    d = int(h.size(-1))
    d_sae = method.config.sae.expansion * d
    shape = GatedSAEConfig(d_in=d, d_sae=d_sae, input_scale=input_scale(h))
    method.sae = freeze(GatedSAE(shape, seed=0)).to(ctx.device)


def hf_case(system: str, args: argparse.Namespace, stamp: Callable[[], None]) -> None:
    """The same workload in ``transformers.Trainer`` or TRL's ``SFTTrainer``."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging

    from forgetless.models.gguf import converted_model_dir

    hf_logging.set_verbosity_error()
    folder = str(converted_model_dir("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=PROJECTIONS,
        layers_to_transform=LAYERS, task_type="CAUSAL_LM",
    )  # fmt: skip
    features = workload_features(tokenizer, args)

    class Stamps(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            stamp()

    common = dict(
        output_dir=tempfile.mkdtemp(prefix="forgetless-peers-"), max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.batch_size, learning_rate=LR, weight_decay=0.0,
        lr_scheduler_type="constant", optim="adamw_torch_fused", max_grad_norm=1.0,
        use_cpu=True, report_to=[], save_strategy="no", logging_steps=10_000,
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    if system == "trl":
        from trl import SFTConfig, SFTTrainer

        rows = [
            {"input_ids": f["input_ids"], "completion_mask": [int(x != -100) for x in f["labels"]]}
            for f in features
        ]
        # TRL's defaults turn on bf16 autocast and gradient checkpointing: off, as for the others
        sft = SFTConfig(
            **common, completion_only_loss=True, max_length=None, bf16=False,  # type: ignore[arg-type]
            gradient_checkpointing=False,
        )  # fmt: skip
        trainer: Any = SFTTrainer(
            model=get_peft_model(model, lora), args=sft, train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer, callbacks=[Stamps()],
        )  # fmt: skip
    else:
        from transformers import Trainer, TrainingArguments, default_data_collator

        rows = [{**f, "attention_mask": [1] * len(f["input_ids"])} for f in features]
        trainer = Trainer(
            model=get_peft_model(model, lora), args=TrainingArguments(**common),  # type: ignore[arg-type]
            train_dataset=Dataset.from_list(rows), data_collator=default_data_collator,
            callbacks=[Stamps()],
        )  # fmt: skip
    trainer.train()


def train_case(case: str, args: argparse.Namespace, stamp: Callable[[], None]) -> float:
    """Runs a case's steps; returns the tokens a step trains on."""
    import torch

    torch.set_num_threads(args.threads)
    system, _, method = case.partition(":")
    if system == "forgetless":
        return forgetless_case(method or "seq_ft", args, stamp)
    hf_case(system, args, stamp)
    return float(args.batch_size * args.length)


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """One case in this process (the child): its step end times and its peak memory."""
    stamps: list[float] = []
    tokens = train_case(case, args, lambda: stamps.append(time.time()))
    steps = [b - a for a, b in itertools.pairwise(stamps)][args.warmup - 1 :]
    return {
        "first_step_s": stamps[0] - args.launched,
        "step_s": steps,
        "peak_rss_mb": _peak_rss_mb(),
        "tokens_per_step": tokens,
    }


def profile_case(case: str, args: argparse.Namespace) -> str:
    """Where a case's timed steps spend their time: torch's operator table, by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU])
    done: list[int] = []

    def stamp() -> None:
        done.append(1)
        if len(done) == args.warmup:  # the warm-up is over: the timed steps are profiled
            profiler.__enter__()

    train_case(case, args, stamp)
    profiler.__exit__(None, None, None)
    return str(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def launch(case: str, args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--steps", args.steps, "--warmup", args.warmup, "--threads", args.threads]
    flags += ["--length", args.length, "--batch-size", args.batch_size, "--n-train", args.n_train]
    command = [sys.executable, __file__, "--case", case, *map(str, flags)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    launched = time.time()
    command += ["--launched", repr(launched)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per case: its median step, tokens/s, first step and peak, each with its range over
    repeats; and the ratio of forgetless's tokens/s to its (within each repeat)."""
    ours = [statistics.median(r["step_s"]) for r in runs["forgetless"]]
    our_tokens = [r["tokens_per_step"] / s for r, s in zip(runs["forgetless"], ours, strict=True)]
    rows = {}
    for case, records in runs.items():
        steps = [statistics.median(r["step_s"]) for r in records]
        ratios = [s / o for s, o in zip(steps, ours, strict=True)]
        tokens = [r["tokens_per_step"] / s for r, s in zip(records, steps, strict=True)]
        rows[case] = {
            "step_s": _spread(steps),
            "tokens_per_s": _spread(tokens),
            "token_time_over_forgetless": _spread(
                [o / t for o, t in zip(our_tokens, tokens, strict=True)]
            ),
            "first_step_s": _spread([r["first_step_s"] for r in records]),
            "peak_rss_mb": _spread([r["peak_rss_mb"] for r in records]),
            "step_over_forgetless": _spread(ratios),
        }
    return rows


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "range": [min(values), max(values)]}


LABELS = {
    "forgetless": "forgetless (`seq_ft`)",
    "trainer": "transformers `Trainer`",
    "trl": "TRL `SFTTrainer`",
    "forgetless:kl_sft": "forgetless (`kl_sft`)",
    "forgetless:sae_fd": "forgetless (`sae_fd`)",
}


def _cell(spread: dict[str, Any], fmt: str) -> str:
    low, high = spread["range"]
    return f"{spread['median']:{fmt}} [{low:{fmt}}–{high:{fmt}}]"


def targets(rows: dict[str, Any]) -> list[tuple[str, dict[str, Any], float, bool]]:
    """Issue 50's targets on this workload, each as (what, measured spread, bound, met): a
    peer's step over forgetless's at least its bound; the rest at most theirs."""
    out = []
    for case, bound in (("trainer", 1.3), ("trl", 2.0)):
        if case in rows:
            spread = rows[case]["step_over_forgetless"]
            out.append(
                (f"{LABELS[case]} step ÷ forgetless step", spread, bound, spread["median"] >= bound)
            )
    if "trainer" in rows:
        first = (
            rows["forgetless"]["first_step_s"]["median"] / rows["trainer"]["first_step_s"]["median"]
        )
        spread = {"median": first, "range": [first, first]}
        out.append(("forgetless first step ÷ the `Trainer`'s (medians)", spread, 1.5, first <= 1.5))
    if "forgetless:kl_sft" in rows:
        spread = rows["forgetless:kl_sft"]["step_over_forgetless"]
        out.append(("`kl_sft` step ÷ `seq_ft` step", spread, 1.3, spread["median"] <= 1.3))
        peak = (
            rows["forgetless:kl_sft"]["peak_rss_mb"]["median"]
            / rows["forgetless"]["peak_rss_mb"]["median"]
        )
        spread = {"median": peak, "range": [peak, peak]}
        out.append(("`kl_sft` peak ÷ `seq_ft` peak (medians)", spread, 1.1, peak <= 1.1))
    if "forgetless:sae_fd" in rows:
        spread = rows["forgetless:sae_fd"]["token_time_over_forgetless"]
        out.append(("`sae_fd` time per token ÷ `seq_ft`'s", spread, 1.2, spread["median"] <= 1.2))
    return out


def render_table(report: dict[str, Any]) -> str:
    """The table docs/performance.md quotes, its targets, and where and how it was measured."""
    rows = report["rows"]
    lines = [
        "| system | s/step | tokens/s | first step, s | peak RSS, MB | step ÷ forgetless step |",
        "|---|---|---|---|---|---|",
    ]
    for case, row in rows.items():
        lines.append(
            f"| {LABELS.get(case, case)} | {_cell(row['step_s'], '.2f')} | "
            f"{_cell(row['tokens_per_s'], '.0f')} | {_cell(row['first_step_s'], '.1f')} | "
            f"{row['peak_rss_mb']['median']:.0f} | {_cell(row['step_over_forgetless'], '.2f')} |"
        )
    lines += ["", "| target | measured | bound | met |", "|---|---|---|---|"]
    for what, spread, bound, met in targets(rows):
        lines.append(f"| {what} | {_cell(spread, '.2f')} | {bound:g} | {'yes' if met else 'no'} |")
    from run_all import load_words, machine_words  # benchmarks/ is on sys.path

    s = report["settings"]
    lines.append(
        f"\n{s['repeats']} interleaved repeats of {s['warmup']} warm-up + {s['steps']} timed "
        f"steps, batch {s['batch_size']} × {s['length']} tokens; medians [range over repeats]. "
        f"On {machine_words(report['machine'])}, commit `{report['commit'][:7]}`, "
        f"{load_words(report['load_average'])}."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=61, help="tokens per example")
    parser.add_argument("--n-train", type=int, default=600, help="examples drawn to find them")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--profile", metavar="CASE", help="profile one case's timed steps")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args)))
        return
    if args.profile:
        print(profile_case(args.profile, args))
        return
    measure_all(args)


def measure_all(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from run_all import commit, machine

    from forgetless.core.storage import atomic_write_json

    cases = args.cases.split(",")
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    load_before = os.getloadavg()[0]
    for repeat in range(args.repeats):
        for case in cases if repeat % 2 == 0 else cases[::-1]:
            runs[case].append(launch(case, args))
            step = statistics.median(runs[case][-1]["step_s"])
            print(f"  {case} repeat {repeat + 1}/{args.repeats}: {step:.2f} s/step", flush=True)
    report = {
        "commit": commit(),
        "machine": machine(args.threads),
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "settings": {k: v for k, v in vars(args).items() if k not in ("case", "launched", "out")},
        "rows": summarize(runs),
        "runs": runs,
    }
    atomic_write_json(args.out, report)
    print(json.dumps(report["rows"], indent=1))


if __name__ == "__main__":
    main()
