"""``forgetless merge`` beside mergekit on the same base and fine-tunes: how far apart the merged
weights are, per merge rule and convention.

Needs mergekit in its own environment (it is not a dependency of forgetless)::

    python3 -m venv /tmp/mk && /tmp/mk/bin/pip install torch==2.13.0 && \\
        /tmp/mk/bin/pip install mergekit==0.1.5
    python benchmarks/mergekit_agreement.py --mergekit /tmp/mk/bin/mergekit-yaml --size tiny
    python benchmarks/mergekit_agreement.py --mergekit /tmp/mk/bin/mergekit-yaml --size 135m

The models are random Llamas under a seed (``135m`` has SmolLM2-135M's shapes, 134.5M
parameters); each fine-tune is the base plus Gaussian noise (σ 0.01) on every tensor, so every
entry disagrees somewhere and TIES's trimming and sign election matter.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from run_all import machine  # benchmarks/ is on sys.path
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

SIZES = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    ),
    "135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152,
    ),
}  # fmt: skip
CASES = [
    # (label, forgetless method, mergekit method + parameters, task weight)
    ("task arithmetic, w 1", {"name": "task_arithmetic"}, ("task_arithmetic", {}), 1.0),
    ("task arithmetic, w 0.5", {"name": "task_arithmetic"}, ("task_arithmetic", {}), 0.5),
    ("TIES k 0.5, w 1 (paper)", {"name": "ties", "density": 0.5}, ("ties", {"density": 0.5}), 1.0),
    (
        "TIES k 0.5, w 0.5 (paper)",
        {"name": "ties", "density": 0.5},
        ("ties", {"density": 0.5}),
        0.5,
    ),
    (
        "TIES k 0.5, w 0.5 (mergekit)",
        {"name": "ties", "density": 0.5, "convention": "mergekit"},
        ("ties", {"density": 0.5}),
        0.5,
    ),
    ("TIES k 0.2, w 1 (paper)", {"name": "ties", "density": 0.2}, ("ties", {"density": 0.2}), 1.0),
    (
        "TIES k 0.2, w 1 (mergekit)",
        {"name": "ties", "density": 0.2, "convention": "mergekit"},
        ("ties", {"density": 0.2}),
        1.0,
    ),
    (
        "TIES k 0.2, w 0.5, normalize false (mergekit)",
        {"name": "ties", "density": 0.2, "convention": "mergekit", "normalize": False},
        ("ties", {"density": 0.2, "normalize": False}),
        0.5,
    ),
]


def build(root: Path, size: str, tasks: int = 2) -> tuple[Path, list[Path]]:
    cfg = LlamaConfig(**SIZES[size], tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(root / "base"))
    paths = []
    for t in range(tasks):
        gen = torch.Generator().manual_seed(100 + t)
        with torch.no_grad():
            tuned = LlamaForCausalLM(cfg)
            tuned.load_state_dict(model.state_dict())
            for p in tuned.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
        tuned.save_pretrained(str(root / f"task{t}"))
        paths.append(root / f"task{t}")
    return root / "base", paths


def run_forgetless(root: Path, base: Path, tasks: list[Path], method: dict, weight: float) -> Path:
    config = {
        "base_model": str(base),
        "tasks": [{"path": str(p), "weight": weight} for p in tasks],
        "method": method,
    }
    (root / "fl.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    out = root / "fl-out"
    command = [sys.executable, "-m", "forgetless", "merge", str(root / "fl.yaml"), "--out"]
    subprocess.run([*command, str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def run_mergekit(
    root: Path, exe: str, base: Path, tasks: list[Path], method: tuple[str, dict], weight: float
) -> Path:
    name, params = method
    models = [{"model": str(p), "parameters": {"weight": weight}} for p in tasks]
    config = {
        "merge_method": name,
        "base_model": str(base),
        "models": models,
        "parameters": params,
        "dtype": "float32",
    }
    (root / "mk.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    out = root / "mk-out"
    command = [exe, str(root / "mk.yaml"), str(out), "--no-copy-tokenizer"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def compare(a: Path, b: Path) -> dict[str, Any]:
    left, right = weights(a), weights(b)
    shared = sorted(set(left) & set(right))
    diffs = [float((left[k].float() - right[k].float()).abs().max()) for k in shared]
    equal = all(torch.equal(left[k], right[k]) for k in shared)
    return {"tensors": len(shared), "max_abs_diff": max(diffs), "bit_identical": equal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mergekit", required=True, help="path of mergekit-yaml")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = args.out or Path(__file__).parent / "results" / f"mergekit_agreement_{args.size}.json"
    rows = []
    with tempfile.TemporaryDirectory(prefix="mk-agree-") as tmp:
        root = Path(tmp)
        base, tasks = build(root, args.size)
        for label, ours, theirs, weight in CASES:
            start = time.perf_counter()
            a = run_forgetless(root, base, tasks, ours, weight)
            b = run_mergekit(root, args.mergekit, base, tasks, theirs, weight)
            row = {"case": label, **compare(a, b), "seconds": round(time.perf_counter() - start)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    version = subprocess.run(
        [str(Path(args.mergekit).with_name("python")), "-c",
         "import importlib.metadata as m; print(m.version('mergekit'))"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    report = {
        "size": args.size,
        "commit": commit.stdout.strip(),
        "machine": machine(1),
        "cases": [
            {"case": c[0], "forgetless": c[1], "mergekit": c[2], "weight": c[3]} for c in CASES
        ],
        "mergekit": version,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
