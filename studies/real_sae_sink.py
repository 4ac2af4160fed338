"""How much of the real SAE's explained variance is the first token's: a control for its metrics.

    python studies/real_sae_sink.py [SAE_DIR] [--n 100] [--out FILE]

On SmolLM2-135M-Instruct the last MLP's output at a prompt's first position (the chat template's
``<|im_start|>``, the same token in every example) is an order of magnitude larger than anywhere
else. A reconstruction that only knew "first position or not" would already explain a share of
the variance; this script measures that share beside the SAE's own figures, on all tokens and
on the tokens after the first. SAE_DIR defaults to the SAE the real campaign's ``sae_fd`` runs
read (the cache folder of ``studies/configs/real.yaml``'s settings). Writes
``studies/results/real_sae_sink.json`` (or FILE) with the commit and the machine.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import benchmarks_path  # noqa: F401  (puts benchmarks/ on sys.path)
import torch
import yaml
from run_all import commit, machine
from torch import Tensor

from forgetless.config.schema import ModelConfig
from forgetless.core.storage import atomic_write_json
from forgetless.models.loading import load_model_and_tokenizer, resolve_source
from forgetless.sae.activations import (
    collect_mlp_outputs,
    example_features,
    model_fingerprint,
    sae_examples,
    shared_sae_dir,
)
from forgetless.sae.gated import load_sae
from forgetless.sae.train import SAETrainConfig, sae_metrics

OUT = Path(__file__).parent / "results" / "real_sae_sink.json"
CAMPAIGN = Path(__file__).parent / "configs" / "real.yaml"


def campaign_sae() -> tuple[str, SAETrainConfig, int]:
    """The real campaign's model, the SAE settings its ``sae_fd`` variant trains, and its
    max_length: what names the SAE its runs read."""
    data = yaml.safe_load(CAMPAIGN.read_text(encoding="utf-8"))
    variant = next(v for v in data["bench"]["variants"] if v["name"] == "sae_fd")
    settings = SAETrainConfig.model_validate(variant["method"]["sae"])
    return data["model"]["name_or_path"], settings, data["train"]["max_length"]


def explained_by_position(acts: Tensor, first: Tensor) -> float:
    """Explained variance of predicting each token by the mean of its group (first or not)."""
    total = (acts - acts.mean(0)).pow(2).sum()
    resid = sum((acts[g] - acts[g].mean(0)).pow(2).sum() for g in (first, ~first))
    return float(1 - resid / total)


def norms(acts: Tensor, first: Tensor) -> dict[str, float]:
    n = acts.norm(dim=-1)
    squares = acts.pow(2).sum(-1)
    return {
        "first_mean_norm": float(n[first].mean()),
        "rest_median_norm": float(n[~first].median()),
        "first_share_of_squares": float(squares[first].sum() / squares.sum()),
        "first_share_of_tokens": float(first.float().mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sae_dir", type=Path, nargs="?")
    parser.add_argument("--n", type=int, default=100, help="Held-out examples per source.")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    name, settings, max_length = campaign_sae()
    model, tokenizer = load_model_and_tokenizer(
        ModelConfig.model_validate({"name_or_path": name}), resolve_source(name)
    )
    folder = args.sae_dir or shared_sae_dir(
        model_fingerprint(model, tokenizer), settings, max_length
    )
    sae = load_sae(folder)
    examples = sae_examples(settings.tasks, args.n, 0, "eval")
    features = example_features(examples, tokenizer, max_length)
    acts = collect_mlp_outputs(model, features, tokenizer.pad_token_id, torch.device("cpu"))
    first = torch.cat(
        [torch.arange(len(f["input_ids"])) == 0 for f in features]
    )  # right-padded rows: each example's tokens in order
    rest = ~first
    result: dict[str, Any] = {
        "sae": str(folder),
        "examples": len(features),
        "norms": norms(acts, first),
        "explained_by_position_alone": explained_by_position(acts, first),
        "sae_all_tokens": sae_metrics(sae, acts).as_dict(),
        "sae_after_first": sae_metrics(sae, acts[rest]).as_dict(),
        "commit": commit(),
        "machine": machine(threads),
    }
    atomic_write_json(args.out, result)
    print({k: v for k, v in result.items() if k not in ("machine",)})


if __name__ == "__main__":
    main()
