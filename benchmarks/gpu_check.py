"""One device check: per-method tokens/s and peak memory of a model built from a config, the same
workload in TRL's SFTTrainer, QLoRA on that model, and the memory plan against each peak.

Nothing is downloaded: the model is a randomly initialised Llama of a given shape (``--shape``:
``llama1b`` is TinyLlama-1.1B's, ``smollm2`` SmolLM2-135M's, ``builtin`` the built-in tiny
model's as a Llama, ``tiny`` the dry run's), written as a
config.json-only folder that the memory plan reads (``forgetless.models.memory_plan``). Every
batch is ``--batch-size`` sequences of ``--length`` tokens, every token labelled, so there is no
padding (padding-free changes nothing here) and the plan's worst case is the workload.

Each case runs in a fresh process (forked on a CPU, a new interpreter on CUDA), which builds the
model, runs one past task of ``--state-steps`` steps to build the method's state
(``method_harness``), warms up, then times ``--steps`` steps through forgetless's own step loop
and the method's hooks. Peak: CUDA's ``max_memory_allocated`` on a GPU; on a CPU the peak of
live tensors from torch's memory profiler (``tensor_timeline``), since a small model's tensors
are far below the process's own resident memory.

    python benchmarks/gpu_check.py --dry-run          # CPU, tiny shape, seconds
    benchmarks/gpu_check.sh                           # one H100: ~1B Llama, bf16, checkpointing

The report goes to ``benchmarks/results/gpu/gpu_check.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from method_harness import Bench  # benchmarks/ is on sys.path
from peak_memory import peak_mb, run_forked, start_window

from forgetless.core.storage import atomic_write_json

OUT = Path(__file__).parent / "results" / "gpu" / "gpu_check.json"
SHAPES: dict[str, dict[str, Any]] = {
    "llama1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "smollm2": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    ),
    "builtin": dict(
        vocab_size=99,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=99,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}
"""Model shapes by name (Llama architecture, ``max_position_embeddings`` 2048)."""
GPU_METHODS = "seq_ft,ewc,kl_sft,asft,replay,sae_fd,o_lora"
"""Step-loop methods whose state the plan predicts and the harness builds in seconds."""


def write_config_folder(shape: str, dtype: str, folder: Path) -> Path:
    """A folder holding only the shape's config.json (what the memory plan reads)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, torch_dtype=dtype)
    config.save_pretrained(folder)
    return folder


def run_config(args: argparse.Namespace, method: str, mode: str) -> Any:
    """The forgetless run config the case stands for (two tasks: the past one and the timed)."""
    from forgetless.config.schema import RunConfig

    regime = "per_task" if method == "o_lora" else "carry"
    data: dict[str, Any] = {
        "model": {"name_or_path": str(args.config_dir), "dtype": args.dtype},
        "finetune": {"mode": mode, "lora": {"regime": regime}},
        "train": {"batch_size": args.batch_size, "max_length": args.length},
        "tasks": ["reverse", "cipher"],
        "method": method,
    }
    if mode == "qlora":
        data["finetune"]["mode"] = "lora"
        data["model"]["quantization"] = {"bits": 4}
    return RunConfig.model_validate(data)


def planned(args: argparse.Namespace, method: str, mode: str) -> dict[str, float | str]:
    """The memory plan's components for the case, in MiB."""
    from forgetless.models.memory_plan import meta_model, plan_method, shape_of

    run = run_config(args, method, mode)
    plan = plan_method(shape_of(meta_model(run), run), run, run.method, args.checkpointing)
    return {k: v if isinstance(v, str) else v / 2**20 for k, v in plan.row().items()}


class ShapeBench(Bench):
    """The harness's method run on a model of ``--shape``, batches of ``--length`` tokens."""

    def _base(self) -> torch.nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        args = self.args
        config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=2048)
        torch.manual_seed(0)
        with torch.device(self.device):
            model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
        if args.qlora:
            model = quantized_copy(model, args)
        if args.checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        return model

    def features(self, index: int, n_train: int) -> list[dict[str, list[int]]]:
        gen = torch.Generator().manual_seed(index)
        low, high = 4, len(self.tokenizer)  # the char tokenizer's ids, so any text decodes
        ids = torch.randint(low, high, (n_train, self.args.length), generator=gen).tolist()
        return [{"input_ids": row, "labels": list(row)} for row in ids]


def quantized_copy(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """``model`` saved and reloaded through forgetless's 4-bit loading (``model.quantization``)."""
    from forgetless.config.schema import ModelConfig
    from forgetless.models.loading import load_model

    folder = Path(tempfile.mkdtemp(prefix="forgetless-qlora-"))
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    cfg = ModelConfig.model_validate({"name_or_path": str(folder), "quantization": {"bits": 4}})
    return load_model(str(folder), cfg)


@contextmanager
def tensor_timeline() -> Iterator[dict[str, float]]:
    """The peak of live CPU tensors while open, in MiB (``["mb"]`` once closed): torch's memory
    profiler timeline, which counts every tensor the window allocates or uses (the weights and
    a method's state included), as CUDA's allocator peak does on a GPU. The resident set also
    holds the process's code and the autograd graph, which a small model cannot outweigh."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    out: dict[str, float] = {}
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        yield out
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    out["mb"] = max((sum(row) for row in sizes), default=0) / 2**20


def method_case(args: argparse.Namespace, method: str, mode: str) -> dict[str, Any]:
    """One method's timed task after one past task: tokens/s, peak and the plan beside it."""
    warnings.simplefilter("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    case = argparse.Namespace(**{**vars(args), "qlora": mode == "qlora"})
    bench = ShapeBench(method, "lora" if mode == "qlora" else mode, case)
    bench.past_task()
    cuda = bench.device.type == "cuda"
    if cuda:
        row = bench.timed_task()
        measured, how = row["peak_mb"], row["memory"]
    else:  # the profiler's own records swell the resident set: its peak is not reported
        with tensor_timeline() as peak:
            row = bench.timed_task()
        measured, how = peak["mb"], "torch memory profiler: live tensors (CPU)"
    plan = planned(args, method, mode)
    return {
        "method": method,
        "mode": mode,
        "tokens_per_s": args.batch_size * args.length / row["step_s"],
        "step_s": row["step_s"],
        "peak_mb": measured,
        "memory": how,
        "plan_mb": plan,
        "plan_error": plan["peak"] / measured - 1 if measured > 0 else None,
    }


def trl_case(args: argparse.Namespace) -> dict[str, Any]:
    """The seq_ft workload (full fine-tuning) in TRL's SFTTrainer: tokens/s and peak."""
    warnings.simplefilter("ignore")
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    bench = ShapeBench("seq_ft", "full", argparse.Namespace(**{**vars(args), "qlora": False}))
    model, device = bench.finetuner.model, bench.device
    rows = bench.features(1, args.n_train)
    dataset = Dataset.from_list([{"input_ids": r["input_ids"]} for r in rows])
    stamps: list[float] = []
    window = {"hwm": False}

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, _a: Any, state: Any, _c: Any, **_: Any) -> None:
            if state.global_step == args.warmup:
                window["hwm"] = start_window(device)
            stamps.append(time.perf_counter())

    config = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="forgetless-trl-"),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.warmup + args.steps,
        learning_rate=1e-3,
        max_length=args.length,
        bf16=args.dtype == "bfloat16" and device.type == "cuda",
        gradient_checkpointing=args.checkpointing,
        padding_free=args.padding_free,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=device.type == "cpu",
        dataloader_num_workers=0,
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=bench.tokenizer,
        callbacks=[Clock()],
    )
    cuda = device.type == "cuda"
    with nullcontext({}) if cuda else tensor_timeline() as timeline:
        trainer.train()
    times = [
        b - a for a, b in zip(stamps[args.warmup : -1], stamps[args.warmup + 1 :], strict=True)
    ]
    peak, how = peak_mb(device, window["hwm"])
    if not cuda:
        peak, how = timeline["mb"], "torch memory profiler: live tensors (CPU)"
    step = sorted(times)[len(times) // 2] if times else float("nan")
    return {
        "method": "trl_sft",
        "mode": "full",
        "tokens_per_s": args.batch_size * args.length / step,
        "step_s": step,
        "peak_mb": peak,
        "memory": how,
    }


def in_new_process(fn_name: str, args: argparse.Namespace, *case: str) -> dict[str, Any]:
    """A case in a fresh process: forked on a CPU, a new interpreter on CUDA (no fork after
    CUDA is touched)."""
    if not args.cuda:
        result: dict[str, Any] = run_forked(globals()[fn_name], args, *case)
        return result
    payload = json.dumps({"fn": fn_name, "case": case, "args": _plain(args)})
    out = subprocess.run(
        [sys.executable, __file__, "--case", payload], check=True, capture_output=True, text=True
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result


def _plain(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def run_case_from_json(payload: str) -> None:
    spec = json.loads(payload)
    args = argparse.Namespace(**spec["args"])
    args.config_dir = Path(args.config_dir)
    print(json.dumps(globals()[spec["fn"]](args, *spec["case"])))


def cases(args: argparse.Namespace) -> list[tuple[str, tuple[str, ...]]]:
    """Every case to run, in order: the methods in each mode, TRL, QLoRA."""
    from method_harness import supports

    out = [
        ("method_case", (name, mode))
        for mode in args.modes.split(",")
        for name in args.methods.split(",")
        if supports(name, mode)
    ]
    if args.trl:
        out.append(("trl_case", ()))
    if args.qlora_case:
        out.append(("method_case", ("seq_ft", "qlora")))
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, two methods")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--state-steps", type=int, default=2, help="steps of the past task")
    parser.add_argument("--n-train", type=int, default=64)
    parser.add_argument("--methods", default=GPU_METHODS)
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--padding-free", action="store_true", help="TRL's padding_free")
    parser.add_argument("--no-trl", dest="trl", action="store_false")
    parser.add_argument("--no-qlora", dest="qlora_case", action="store_false")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=420, help="start no case after this")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.shape, args.dtype, args.batch_size, args.length = "tiny", "float32", 2, 32
        args.steps, args.warmup, args.state_steps, args.n_train = 2, 1, 1, 8
        args.methods, args.modes, args.qlora_case = "seq_ft,ewc", "full,lora", False
        args.trl = False
    args.cuda = torch.cuda.is_available() and not args.dry_run
    if not args.cuda:
        args.qlora_case = False  # bitsandbytes' 4-bit training needs a CUDA GPU
    args.past_n_train = args.n_train
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.case:
        run_case_from_json(args.case)
        return {}
    args.config_dir = write_config_folder(
        args.shape, args.dtype, Path(tempfile.mkdtemp(prefix="forgetless-shape-"))
    )
    rows: list[dict[str, Any]] = []
    began = time.perf_counter()
    for fn_name, case in cases(args):
        start = time.perf_counter()
        if start - began > args.budget_s:
            rows.append({"case": [fn_name, *case], "skipped": f"past --budget-s {args.budget_s}"})
            continue
        try:
            row = in_new_process(fn_name, args, *case)
        except (RuntimeError, subprocess.CalledProcessError) as err:
            stderr = getattr(err, "stderr", "") or ""
            row = {"case": [fn_name, *case], "error": (str(err) + stderr)[-2000:]}
        row["wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
        write_report(args, rows)
    return write_report(args, rows)


def write_report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The report so far (written after every case, so a cut-off run keeps what it measured)."""
    report = {
        "device": torch.cuda.get_device_name(0) if args.cuda else "cpu",
        "settings": {k: v for k, v in _plain(args).items() if k not in ("case", "out")},
        "checkpointing": "gradient_checkpointing_enable (non-reentrant) on the model"
        if args.checkpointing
        else "off",
        "padding_free": "no padding: every sequence is --length tokens",
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, report)
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = main()
    if report and any("error" in r for r in report["rows"]):
        sys.exit(1)
