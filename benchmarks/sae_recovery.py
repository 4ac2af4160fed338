"""Ground-truth feature recovery of the gated SAE, side by side with SAELens (issue 24).

Data with a known dictionary (``forgetless.sae.train.sparse_synthetic_data``): ``--n`` training
vectors in ``R^d`` (d = 128), each the sum of ``--active`` (8) of ``--directions`` (1024) random
unit directions with magnitudes uniform in [0.5, 1.5], plus Gaussian noise (0.01 per element),
scaled so that E‖x‖² = 1; ``--n-eval`` more vectors of the same dictionary are held out for the
metrics. Both SAEs are gated, D = ``--width`` (1024) features, λ_sparse ramped up over the first
100 steps, Adam at lr 1e-3, batch 1024, ``--steps`` (2000) steps, one torch thread.

- forgetless: ``train_sae`` with ``SAETrainConfig`` (its defaults unless given here).
- SAELens (``GatedTrainingSAE`` + ``SAETrainer``, its defaults: decoder columns at norm 0.1,
  encoder = decoderᵀ, L1 weighted by the decoder norms, gradient norm clipped to 1): run in the
  separate interpreter ``--saelens-python`` (SAELens needs its own environment; it is not a
  dependency of forgetless), on the same data and batch order, at ``--saelens-l1``. Skipped when
  that interpreter is missing or cannot import ``sae_lens``.

Per SAE: training steps per second (the training loop alone, data already in memory), normalised
MSE ``Σ‖x − x̂‖² / Σ‖x − mean x‖²`` and L0 (features firing per vector) on the held-out vectors,
and how many ground-truth directions some decoder column matches at cosine > 0.9 (recovered).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sae_recovery.py``; the report goes to
``benchmarks/results/sae_recovery.json``. A quick check that it runs:
``python benchmarks/sae_recovery.py --n 20000 --steps 50 --out /tmp/sae_recovery.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from run_all import machine  # benchmarks/ is on sys.path

from forgetless.core.storage import atomic_write_json

OUT = Path(__file__).parent / "results" / "sae_recovery.json"
SAELENS_PYTHON = Path("/tmp/saelens-venv/bin/python")
THRESHOLD = 0.9
ISSUE = {
    "forgetless": {"steps_per_s": 21.7, "nmse": 0.199, "l0": 63.9, "recovered": 0},
    "saelens": {"steps_per_s": 14.6, "nmse": 0.172, "l0": 12.7, "recovered": 986},
}


def batch_order(n: int, batch_size: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """Row indices of each step's batch: a fresh permutation whenever the rest would run short
    (the order ``train_sae`` draws, so both SAEs see the same batches)."""
    gen = torch.Generator().manual_seed(seed)
    order, cursor = torch.randperm(n, generator=gen), 0
    for _ in range(steps):
        if cursor + min(batch_size, n) > n:
            order, cursor = torch.randperm(n, generator=gen), 0
        yield order[cursor : cursor + batch_size]
        cursor += batch_size


def held_out_metrics(x: torch.Tensor, x_hat: torch.Tensor, codes: torch.Tensor) -> dict[str, float]:
    """Normalised MSE and L0 of one SAE on the held-out vectors."""
    return {
        "nmse": float((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum()),
        "l0": float((codes > 0).float().sum(-1).mean()),
    }


# --- SAELens, in its own interpreter -----------------------------------------------------------


def saelens_worker(data_file: Path, out_file: Path) -> None:
    """Train SAELens's gated SAE on the saved data; save its metrics and decoder (``(d, D)``)."""
    torch.set_num_threads(1)
    from sae_lens import __version__ as saelens_version
    from sae_lens.config import SAETrainerConfig
    from sae_lens.saes.gated_sae import GatedTrainingSAE, GatedTrainingSAEConfig
    from sae_lens.training.sae_trainer import SAETrainer

    blob = torch.load(data_file)
    x, x_eval, s = blob["x"], blob["x_eval"], blob["settings"]
    torch.manual_seed(s["seed"])
    sae = GatedTrainingSAE(
        GatedTrainingSAEConfig(
            d_in=x.size(1),
            d_sae=s["width"],
            l1_coefficient=s["saelens_l1"],
            l1_warm_up_steps=s["l1_warmup_steps"],
        )
    )
    batches = (x[idx] for idx in batch_order(len(x), s["batch_size"], s["steps"], s["seed"]))
    trainer = SAETrainer(
        SAETrainerConfig(
            total_training_samples=s["steps"] * s["batch_size"],
            train_batch_size_samples=s["batch_size"],
            lr=s["lr"],
            lr_end=s["lr"],
        ),
        sae,
        batches,
    )
    start = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - start
    sae.eval()
    with torch.no_grad():
        codes = sae.encode(x_eval)
        x_hat = sae.decode(codes)
    record = {
        "version": saelens_version,
        "steps": trainer.n_training_steps,
        "train_seconds": seconds,
        "steps_per_s": trainer.n_training_steps / seconds,
        **held_out_metrics(x_eval, x_hat, codes),
    }
    torch.save({"record": record, "w_dec": sae.W_dec.detach().T.contiguous()}, out_file)


def run_saelens(
    python: Path, x: torch.Tensor, x_eval: torch.Tensor, settings: dict[str, Any]
) -> tuple[dict[str, Any], torch.Tensor] | str:
    """SAELens's record and decoder, or why it did not run."""
    if not python.is_file():
        return f"no interpreter at {python}"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="disabled")
    probe = subprocess.run([str(python), "-c", "import sae_lens"], env=env, capture_output=True)
    if probe.returncode != 0:
        return f"{python} cannot import sae_lens"
    with tempfile.TemporaryDirectory() as tmp:
        data, out = Path(tmp) / "data.pt", Path(tmp) / "out.pt"
        torch.save({"x": x, "x_eval": x_eval, "settings": settings}, data)
        command = [str(python), __file__, "--saelens-worker", str(data), str(out)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return "SAELens run failed: " + (done.stderr.strip().splitlines() or ["?"])[-1]
        blob = torch.load(out)
    return blob["record"], blob["w_dec"]


# --- forgetless ----------------------------------------------------------------------------------


def run_forgetless(
    x: torch.Tensor, x_eval: torch.Tensor, settings: dict[str, Any]
) -> tuple[dict[str, Any], torch.Tensor]:
    """forgetless's record and decoder (``(d, D)``)."""
    from forgetless.sae.gated import encode, reconstruct
    from forgetless.sae.train import SAETrainConfig, train_sae

    given = {"l1_coeff": settings["forgetless_l1"]} if settings["forgetless_l1"] is not None else {}
    cfg = SAETrainConfig(
        expansion=settings["width"] // x.size(1),
        steps=settings["steps"],
        batch_size=settings["batch_size"],
        lr=settings["lr"],
        l1_warmup=min(1.0, settings["l1_warmup_steps"] / settings["steps"]),
        seed=settings["seed"],
        **given,
    )
    start = time.perf_counter()
    sae, _ = train_sae(x, cfg)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        codes, x_hat = encode(sae, x_eval).f, reconstruct(sae, x_eval)
    record = {
        "config": cfg.model_dump(mode="json"),
        "steps": settings["steps"],
        "train_seconds": seconds,
        "steps_per_s": settings["steps"] / seconds,
        **held_out_metrics(x_eval, x_hat, codes),
    }
    return record, sae.W_dec.detach()


def l1_point(
    x: torch.Tensor,
    x_eval: torch.Tensor,
    directions: torch.Tensor,
    settings: dict[str, Any],
    l1: float,
) -> dict[str, Any]:
    """One forgetless run at λ_sparse = ``l1`` (the sweep behind the default)."""
    record, w_dec = run_forgetless(x, x_eval, {**settings, "forgetless_l1": l1})
    point = {"l1_coeff": l1, **{k: record[k] for k in ("steps_per_s", "nmse", "l0")}}
    point |= recovery(w_dec, directions)
    print("sweep", json.dumps(point), flush=True)
    return point


def recovery(w_dec: torch.Tensor, directions: torch.Tensor) -> dict[str, Any]:
    from forgetless.sae.train import direction_recovery

    best = direction_recovery(w_dec, directions)
    return {
        "recovered": int((best > THRESHOLD).sum()),
        "of": len(directions),
        "mean_max_cos": float(best.mean()),
    }


def commit() -> dict[str, Any]:
    """The checkout the numbers were measured on (``dirty``: uncommitted changes)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200_000, help="training vectors")
    parser.add_argument("--n-eval", type=int, default=20_000, help="held-out vectors")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--directions", type=int, default=1024, help="ground-truth directions")
    parser.add_argument("--active", type=int, default=8, help="directions per vector")
    parser.add_argument("--noise", type=float, default=0.01)
    parser.add_argument("--width", type=int, default=1024, help="SAE features D")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--l1-warmup-steps", type=int, default=100)
    parser.add_argument(
        "--forgetless-l1", type=float, default=None, help="default: SAETrainConfig's l1_coeff"
    )
    parser.add_argument("--saelens-l1", type=float, default=0.2, help="the issue's setting")
    parser.add_argument(
        "--l1-sweep", default="", help="comma-separated λ_sparse values: extra forgetless runs"
    )
    parser.add_argument("--saelens-python", type=Path, default=SAELENS_PYTHON)
    parser.add_argument("--no-saelens", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--saelens-worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.saelens_worker:
        saelens_worker(*args.saelens_worker)
        return

    from forgetless.sae.train import sparse_synthetic_data

    torch.set_num_threads(1)
    data, directions = sparse_synthetic_data(
        args.n + args.n_eval, args.d, args.directions, args.active, args.noise, seed=args.seed
    )
    x, x_eval = data[: args.n].contiguous(), data[args.n :].contiguous()
    settings = {
        k: v for k, v in vars(args).items() if k not in {"out", "saelens_worker", "saelens_python"}
    }
    fl_record, fl_dec = run_forgetless(x, x_eval, settings)
    report: dict[str, Any] = {
        "schema_version": 1,
        "machine": machine(torch.get_num_threads()),
        **commit(),
        "settings": settings,
        "data": {"magnitudes": [0.5, 1.5], "scaled_to": "E|x|^2 = 1", "truth_l0": args.active},
        "recovered_at_cos": THRESHOLD,
        "forgetless": {**fl_record, **recovery(fl_dec, directions)},
    }
    print("forgetless", json.dumps(report["forgetless"]), flush=True)
    sweep = [float(v) for v in args.l1_sweep.split(",") if v.strip()]
    if sweep:
        report["l1_sweep"] = [l1_point(x, x_eval, directions, settings, l1) for l1 in sweep]
    if not args.no_saelens:
        side = run_saelens(args.saelens_python, x, x_eval, settings)
        if isinstance(side, str):
            report["saelens"] = {"skipped": side}
        else:
            report["saelens"] = {**side[0], **recovery(side[1], directions)}
            report["speed_ratio_forgetless_over_saelens"] = round(
                report["forgetless"]["steps_per_s"] / report["saelens"]["steps_per_s"], 3
            )
        print("saelens", json.dumps(report["saelens"]), flush=True)
    report["issue_24_reported"] = ISSUE
    atomic_write_json(args.out, report)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
