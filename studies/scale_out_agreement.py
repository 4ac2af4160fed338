"""How closely 2 processes (2 × batch b/2, gloo) reproduce 1 process (batch b), per method.

For each method: the same two-task config on a tiny saved model, run by ``forgetless run`` and by
``accelerate launch --multi_gpu --num_processes 2 -m forgetless run``; reports the largest relative
and absolute differences of the per-step losses (anchored's KL to its anchor falls to ~1e-5,
where float32 noise is a large relative error) and the largest absolute difference of the final
checkpoint's tensors (weights or adapters, and method state).
Run: ``python studies/scale_out_agreement.py [--methods seq_ft,ewc] [--steps 4]``; the table
goes to ``studies/results/scale_out_agreement.json``. ``--layout fsdp2`` launches the 2 processes
with ``examples/accelerate/cpu_2proc_fsdp2.yaml`` (each holds half of every weight) and keeps its
rows under ``fsdp2`` beside the data-parallel ones; ``--layout zero2`` (and ``zero1``) launches
them under DeepSpeed with ``examples/accelerate/cpu_2proc_zero2.yaml`` (DeepSpeed installed apart,
as docs/scale-out.md says; ``DS_ACCELERATOR=cpu`` is set here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from safetensors.torch import load_file

from forgetless.contract.method import method_class
from forgetless.core.storage import atomic_write_json
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.training.pretrain import SHIPPED_BASE

OUT = Path(__file__).parent / "results" / "scale_out_agreement.json"
FSDP2 = Path(__file__).parents[1] / "examples" / "accelerate" / "cpu_2proc_fsdp2.yaml"
ZERO = Path(__file__).parents[1] / "examples" / "accelerate" / "cpu_2proc_zero2.yaml"
METHODS = {
    "seq_ft": ({"name": "seq_ft"}, "full"),
    "low_lr": ({"name": "low_lr"}, "full"),
    "kl_sft": ({"name": "kl_sft", "beta": 1.0}, "full"),
    "ewc": ({"name": "ewc", "lam": 1e4, "fisher_samples": 8, "fisher_batch_size": 4}, "full"),
    "replay": ({"name": "replay", "buffer_size": 16, "ratio": 0.5}, "full"),
    "freeze": ({"name": "freeze", "train_top_layers": 1}, "full"),
    "task_arithmetic": ({"name": "task_arithmetic", "scaling": 0.5}, "full"),
    "ties": ({"name": "ties", "density": 0.5}, "full"),
    "opcm": ({"name": "opcm", "alpha": 0.5}, "full"),
    "mtl": ({"name": "mtl"}, "full"),
    "o_lora": ({"name": "o_lora"}, "lora"),
    "attribution_gate": ({"name": "attribution_gate", "max_samples": 4}, "full"),
    "attribution_gate-gradient": (
        {"name": "attribution_gate", "max_samples": 4, "gate": "gradient"},
        "full",
    ),
    "anchored": (
        {"name": "anchored", "outer_iterations": 2, "inner_steps": 2, "top_k": 8},
        "full",
    ),
    "sae_fd": (
        {"name": "sae_fd", "sae_cache": "run", "sae": {"steps": 20, "n_per_task": 4}},
        "lora",
    ),
}


SOLVED_FIRST = {"attribution_gate"}
"""Run on the shipped tiny base with `copy`, a task it answers, first: the relevance maps come
from correct answers only, so a model that answers nothing would leave the gate idle."""


def _model(folder: Path) -> Path:
    from forgetless.config.schema import TinyModelConfig

    tokenizer = build_char_tokenizer()
    tiny = TinyModelConfig(
        hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64
    )
    build_tiny_model(tiny, len(tokenizer), seed=0).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def _run(config: Path, out: Path, processes: int, layout: str) -> None:
    args = ["run", str(config), "--out", str(out), "--quiet"]
    mode = {
        "fsdp2": ["--config_file", str(FSDP2)],
        "zero1": ["--config_file", str(ZERO), "--zero_stage", "1"],
        "zero2": ["--config_file", str(ZERO)],
    }.get(layout, ["--multi_gpu"])
    launch = [Path(sys.executable).with_name("accelerate"), "launch", *mode]
    launch += ["--num_processes", str(processes), "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no", "-m", "forgetless"]
    command = launch + args if processes > 1 else [sys.executable, "-m", "forgetless", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    subprocess.run([str(c) for c in command], check=True, env=env, capture_output=True)


def _compare(one: Path, two: Path) -> dict[str, Any]:
    losses = [
        [t["losses"] for t in json.loads((d / "results.json").read_text())["per_task"]]
        for d in (one, two)
    ]
    pairs = [(a, b) for ta, tb in zip(*losses, strict=True) for a, b in zip(ta, tb, strict=True)]
    if not pairs:
        raise SystemExit("no per-step losses recorded")
    rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in pairs)
    gap = max(abs(a - b) for a, b in pairs)
    last = sorted((one / "checkpoints").glob("task-*"))[-1].name
    worst = 0.0
    for path in (one / "checkpoints" / last).rglob("*.safetensors"):
        mine = load_file(str(path))
        theirs = load_file(
            str(two / "checkpoints" / last / path.relative_to(one / "checkpoints" / last))
        )
        for key, tensor in mine.items():
            if tensor.is_floating_point() and tensor.numel():
                worst = max(worst, float((tensor.double() - theirs[key].double()).abs().max()))
    steps = sum(len(t) for t in losses[0])
    return {
        "steps": steps,
        "smallest_loss": min(abs(a) for a, _ in pairs),
        "max_abs_loss_diff": gap,
        "max_rel_loss_diff": rel,
        "max_abs_state_diff": worst,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS), help="rows of METHODS")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--layout", choices=["ddp", "fsdp2", "zero1", "zero2"], default="ddp")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        model = _model(root / "model")
        for name in args.methods.split(","):
            method, mode = METHODS[name]
            regimes = method_class(method["name"]).lora_regimes
            if args.layout == "fsdp2" and not regimes:  # the full-weight paths, sharded
                mode = "full"
            lora = {"r": 2, "regime": regimes[0]} if regimes else {"r": 2}
            raw = {
                "seed": 0,
                "model": {"name_or_path": str(model)},
                "method": method,
                "finetune": {"mode": mode, "lora": lora},
                "train": {"steps": args.steps, "batch_size": 8, "lr": 1e-3, "max_length": 32},
                "eval": {"n_eval": 8, "n_train": 32, "batch_size": 8, "kl_examples": 4},
                "tasks": ["reverse", "cipher"],
                "probes": ["copy"],
            }
            if method["name"] in SOLVED_FIRST:
                raw.update(model={"name_or_path": str(SHIPPED_BASE)}, tasks=["copy", "reverse"])
                raw["probes"] = ["upper"]
            config = root / f"{name}.yaml"
            config.write_text(yaml.safe_dump(raw), encoding="utf-8")
            for processes in (1, 2):
                _run(config, root / f"{name}-{processes}", processes, args.layout)
            rows[name] = _compare(root / f"{name}-1", root / f"{name}-2")
            print(name, rows[name], flush=True)
    report = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {}
    report.update(batch_size=8, processes=[1, 2])
    report.setdefault("methods" if args.layout == "ddp" else args.layout, {}).update(rows)
    atomic_write_json(args.out, report)


if __name__ == "__main__":
    main()
