"""``forgetless merge`` beside mergekit on the same base and fine-tunes: how far apart the merged
weights are, per merge method.

Needs mergekit in its own environment (it is not a dependency of forgetless)::

    python3 -m venv /tmp/mk && /tmp/mk/bin/pip install torch==2.13.0 && \\
        /tmp/mk/bin/pip install mergekit==0.1.5
    python benchmarks/mergekit_agreement.py --mergekit /tmp/mk/bin/mergekit-yaml --size tiny
    python benchmarks/mergekit_agreement.py --mergekit /tmp/mk/bin/mergekit-yaml --size 135m

The models are random Llamas under a seed (``135m`` has SmolLM2-135M's shapes, 134.5M
parameters); each fine-tune is the base plus Gaussian noise (σ 0.01) on every tensor, so every
entry disagrees somewhere and TIES's trimming and sign election matter.

Two kinds of case. *Same YAML*: one mergekit config file, given to ``mergekit-yaml`` and to
``forgetless merge`` as it is (linear, task_arithmetic, ties, dare_linear, dare_ties). *Native*:
a forgetless config beside the mergekit one (the TIES paper convention against mergekit's).

DARE below density 1 draws random masks, and the two tools draw different ones, so those rows
compare statistics (the share of entries the merge changes, the L1 norm of the update) and then
*replay* mergekit's masks: mergekit draws them from torch's global generator seeded by
``--random-seed``, tensor by tensor in name order and model by model in config order; applying
forgetless's DARE functions (``forgetless.merging.dare.drop``, ``merge_dropped``) under those
masks must give mergekit's tensors.
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
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from forgetless.merging.dare import drop, merge_dropped

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
SEED = 0
"""mergekit's ``--random-seed`` (forgetless's DARE seed is its default, also 0)."""
W = (0.7, 0.3)
SAME_YAML = [
    # (label, merge_method, top-level parameters, per-model parameters; "base" lists the base)
    ("linear, no base_model, w 0.7/0.5", "linear", {}, [{"weight": 0.7}, {"weight": 0.5}]),
    ("linear, base listed, w 0.2/0.5/0.3", "linear", {},
     ["base", {"weight": 0.5}, {"weight": 0.3}]),
    ("task_arithmetic, w 0.7/0.3", "task_arithmetic", {}, [{"weight": w} for w in W]),
    ("task_arithmetic, w 0.7/0.3, normalize, lambda 0.8", "task_arithmetic",
     {"normalize": True, "lambda": 0.8}, [{"weight": w} for w in W]),
    ("ties, k 0.5/0.3, w 0.7/0.3", "ties", {},
     ["base", {"weight": 0.7, "density": 0.5}, {"weight": 0.3, "density": 0.3}]),
    ("ties, k 0.2, w 1/0.5, normalize false, lambda 0.9", "ties",
     {"density": 0.2, "normalize": False, "lambda": 0.9}, [{"weight": 1.0}, {"weight": 0.5}]),
    ("dare_linear, k 1, w 0.7/0.3", "dare_linear", {"density": 1.0}, [{"weight": w} for w in W]),
    ("dare_ties, k 1, w 0.7/0.3", "dare_ties", {"density": 1.0}, [{"weight": w} for w in W]),
    ("dare_linear, k 0.5, w 0.7/0.3", "dare_linear", {"density": 0.5},
     [{"weight": w} for w in W]),
    ("dare_ties, k 0.5/0.3, w 0.7/0.3, int8_mask", "dare_ties", {"int8_mask": True},
     [{"weight": 0.7, "density": 0.5}, {"weight": 0.3, "density": 0.3}]),
    ("dare_linear, k 0.5, rescale false, normalize", "dare_linear",
     {"density": 0.5, "rescale": False, "normalize": True}, [{"weight": w} for w in W]),
]  # fmt: skip
NATIVE = [
    # (label, forgetless method, mergekit method + parameters, task weight)
    ("task arithmetic, w 1", {"name": "task_arithmetic"}, ("task_arithmetic", {}), 1.0),
    ("task arithmetic, w 0.5", {"name": "task_arithmetic"}, ("task_arithmetic", {}), 0.5),
    ("TIES k 0.5, w 1 (paper)", {"name": "ties", "density": 0.5}, ("ties", {"density": 0.5}), 1.0),
    ("TIES k 0.5, w 0.5 (paper)", {"name": "ties", "density": 0.5}, ("ties", {"density": 0.5}),
     0.5),
    ("TIES k 0.5, w 0.5 (mergekit)", {"name": "ties", "density": 0.5, "convention": "mergekit"},
     ("ties", {"density": 0.5}), 0.5),
    ("TIES k 0.2, w 1 (paper)", {"name": "ties", "density": 0.2}, ("ties", {"density": 0.2}), 1.0),
    ("TIES k 0.2, w 1 (mergekit)", {"name": "ties", "density": 0.2, "convention": "mergekit"},
     ("ties", {"density": 0.2}), 1.0),
    ("TIES k 0.2, w 0.5, normalize false (mergekit)",
     {"name": "ties", "density": 0.2, "convention": "mergekit", "normalize": False},
     ("ties", {"density": 0.2, "normalize": False}), 0.5),
]  # fmt: skip


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


def mergekit_yaml(
    method: str, params: dict, models: list, base: Path, tasks: list[Path]
) -> dict[str, Any]:
    """A mergekit config: ``models`` pairs with ``tasks`` in order; an entry ``"base"`` lists
    the base model (weight 0.2) before them."""
    listed = [{"model": str(base), "parameters": {"weight": 0.2}}] if models[0] == "base" else []
    own = [m for m in models if m != "base"]
    listed += [{"model": str(p), "parameters": m} for p, m in zip(tasks, own, strict=True)]
    config = {"merge_method": method, "models": listed, "dtype": "float32"}
    if method != "linear" or models[0] == "base":
        config["base_model"] = str(base)
    return config | ({"parameters": params} if params else {})


def run_forgetless(root: Path, config: dict[str, Any]) -> Path:
    (root / "fl.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    out = root / "fl-out"
    command = [sys.executable, "-m", "forgetless", "merge", str(root / "fl.yaml"), "--out"]
    subprocess.run([*command, str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def run_mergekit(root: Path, exe: str, config: dict[str, Any]) -> Path:
    (root / "mk.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    out = root / "mk-out"
    command = [exe, str(root / "mk.yaml"), str(out), "--no-copy-tokenizer"]
    command += ["--random-seed", str(SEED)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def compare(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, Any]:
    shared = sorted(set(ours) & set(theirs))
    diffs = [float((ours[k].float() - theirs[k].float()).abs().max()) for k in shared]
    return {
        "tensors": len(shared),
        "max_abs_diff": max(diffs),
        "max_diff_over_scale": max(
            d / max(float(theirs[k].float().abs().max()), 1e-30)
            for d, k in zip(diffs, shared, strict=True)
        ),  # each tensor's difference over its largest entry: ~6e-8 is float32 rounding
        "bit_identical": all(torch.equal(ours[k], theirs[k]) for k in shared),
    }


def update_stats(merged: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> list[float]:
    """Share of entries the merge changes, and the update's L1 norm, over the model."""
    changed = sum(int((merged[k] != base[k]).sum()) for k in base)
    l1 = sum(float((merged[k].double() - base[k].double()).abs().sum()) for k in base)
    return [changed / sum(v.numel() for v in base.values()), l1]


def replay(
    config: dict[str, Any], base: dict[str, torch.Tensor], tasks: list[Path]
) -> dict[str, torch.Tensor]:
    """mergekit's dare_* merge of ``config`` under mergekit's own masks, by forgetless's
    functions (see the module docstring for the draw order)."""
    params = config.get("parameters", {})
    entries = [m["parameters"] for m in config["models"]]
    densities = [float(m.get("density", params.get("density", 1.0))) for m in entries]
    model_weights = [float(m["weight"]) for m in entries]
    rescale = "l1" if params.get("rescale", True) else "none"
    elect, normalize = config["merge_method"] == "dare_ties", bool(params.get("normalize", False))
    handles = [safe_open(str(p / "model.safetensors"), framework="pt") for p in tasks]
    gen = torch.Generator().manual_seed(SEED)
    out = {}
    for name in sorted(base):
        dropped = []
        for handle, density in zip(handles, densities, strict=True):
            delta = handle.get_tensor(name).float() - base[name].float()
            if density < 1:
                keep = torch.bernoulli(torch.full_like(delta, density), generator=gen)
                delta = drop(delta, keep, 1 - density, rescale)
            dropped.append(delta)
        update = merge_dropped(dropped, model_weights, elect, normalize, 1.0)
        out[name] = base[name].float() + update
    return out


def dare_rows(
    config: dict[str, Any], ours: Path, theirs: Path, base: Path, tasks: list[Path]
) -> dict[str, Any]:
    """Statistics of both merges, and mergekit's masks replayed through forgetless's math."""
    base_w, ours_w, theirs_w = weights(base), weights(ours), weights(theirs)
    fl, mk = update_stats(ours_w, base_w), update_stats(theirs_w, base_w)
    replayed = compare(replay(config, base_w, tasks), theirs_w)
    return {
        "changed_share": {"forgetless": round(fl[0], 5), "mergekit": round(mk[0], 5)},
        "update_l1_ratio": round(fl[1] / mk[1], 5),
        "replay": {k: replayed[k] for k in ("max_abs_diff", "bit_identical")},
    }


def run_case(
    root: Path, exe: str, label: str, ours: dict[str, Any], theirs: dict[str, Any]
) -> dict[str, Any]:
    start = time.perf_counter()
    a, b = run_forgetless(root, ours), run_mergekit(root, exe, theirs)
    row = {"case": label, **compare(weights(a), weights(b))}
    method = theirs["merge_method"]
    params, models = theirs.get("parameters", {}), theirs["models"]
    random = method.startswith("dare") and any(
        float(m["parameters"].get("density", params.get("density", 1.0))) < 1 for m in models
    )
    if random and ours is theirs:
        tasks = [Path(m["model"]) for m in models]
        row |= dare_rows(theirs, a, b, Path(theirs["base_model"]), tasks)
    return row | {"seconds": round(time.perf_counter() - start)}


def cases(base: Path, tasks: list[Path]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(label, forgetless config, mergekit config): the same dict for a same-YAML case."""
    out = []
    for label, method, params, models in SAME_YAML:
        config = mergekit_yaml(method, params, models, base, tasks)
        out.append((f"same YAML: {label}", config, config))
    for label, ours, (method, params), weight in NATIVE:
        models = [{"weight": weight}] * len(tasks)
        theirs = mergekit_yaml(method, params, models, base, tasks)
        native = {
            "base_model": str(base),
            "tasks": [{"path": str(p), "weight": weight} for p in tasks],
            "method": ours,
        }
        out.append((f"native: {label}", native, theirs))
    return out


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
        for label, ours, theirs in cases(base, tasks):
            row = run_case(root, args.mergekit, label, ours, theirs)
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_report(out, args, rows)


def write_report(out: Path, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
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
        "same_yaml_cases": [
            {"case": c[0], "merge_method": c[1], "parameters": c[2], "models": c[3]}
            for c in SAME_YAML
        ],
        "native_cases": [
            {"case": c[0], "forgetless": c[1], "mergekit": c[2], "weight": c[3]} for c in NATIVE
        ],
        "mergekit": version,
        "mergekit_random_seed": SEED,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(compact_json(report), encoding="utf-8")
    print(f"wrote {out}")


def compact_json(report: dict[str, Any]) -> str:
    """One line per key, and one per case or row in a list."""
    lines = []
    for key, value in report.items():
        if isinstance(value, list):
            inner = ",\n".join(f"    {json.dumps(item)}" for item in value)
            lines.append(f"  {json.dumps(key)}: [\n{inner}\n  ]")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


if __name__ == "__main__":
    main()
