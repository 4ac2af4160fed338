"""``forgetless diagnose circuits`` and ``diagnose drift``: checkpoints in, a metrics table out.

Checkpoints are Hugging Face model folders, the first one the base (the ``rl`` method saves
``start``, ``sft-epoch-E`` and ``rl-epoch-E`` folders per task). The behaviour is a built-in
task's eval prompts and answers, or a JSONL file of prompt/completion lines (an optional
``counterfactual`` field holds a corrupted prompt of the same token length).
"""

from __future__ import annotations

import os
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from forgetless.core.storage import temp_file_name
from forgetless.diagnostics import circuit_metrics as cm
from forgetless.diagnostics.circuits import (
    Batch,
    behaviour,
    counterfactual,
    head_effects,
    head_effects_attribution,
    train_masks,
)
from forgetless.errors import DataError, ForgetlessError
from forgetless.tasks.base import Example, Task
from forgetless.tasks.formatting import collate, completion_window, encode_example

EPOCH_LABEL = re.compile(r"^(sft|rl)-epoch-(\d+)$")


@dataclass(frozen=True)
class DBMSettings:
    steps: int = 200
    lr: float = 0.1
    temperature: float = 1.0
    sparsity: float = 0.05
    seed: int = 0
    final_temperature: float | None = None  # anneal τ to this (binary masks); None: constant
    straight_through: bool = False  # hard masks forward, sigmoid gradient backward


@dataclass(frozen=True)
class Thresholds:
    shift: float = 0.1  # |Δm_h| above this: amplified or weakened
    specialist: float = 0.1  # share of m(M) − m(∅) for necessity and sufficiency
    vulnerability: float = 0.1  # δ of differential vulnerability


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_checkpoint(folder: Path) -> tuple[nn.Module, Any]:
    """A model folder as (float32 model in eval mode on the device, tokenizer)."""
    from transformers.utils import logging as hf_logging

    from forgetless.config.schema import ModelConfig
    from forgetless.errors import ModelLoadError
    from forgetless.models.loading import load_tokenizer, resolve_source
    from forgetless.training.export import run_folder_advice

    hf_logging.disable_progress_bar()
    advice = run_folder_advice(folder)
    if advice:
        raise ModelLoadError(f"CHECKPOINTS: {advice}")
    source = resolve_source(str(folder))
    model: Any = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.to(device()).eval()
    return model, load_tokenizer(source, ModelConfig.model_validate({}))


def corrupt_prompt(prompt: str, rng: random.Random) -> str:
    """Every letter and digit after the first word swapped for another of its kind (same
    length in characters): the task marker stays, the content changes."""
    head, sep, rest = prompt.partition(" ")
    if not sep:
        head, rest = "", prompt
    pools = (string.ascii_lowercase, string.ascii_uppercase, string.digits)

    def swap(ch: str) -> str:
        pool = next((p for p in pools if ch in p), None)
        return rng.choice(pool.replace(ch, "")) if pool else ch

    return head + sep + "".join(swap(ch) for ch in rest)


def behaviour_task(spec: str, n: int, seed: int) -> tuple[Task, list[str | None]]:
    """A built-in task by name, or a JSONL file; with each example's counterfactual prompt."""
    import json

    from forgetless.tasks.builtin import build_builtin_task, known_task_names

    if spec in known_task_names():
        task = build_builtin_task(spec, 0, n, seed)
        rng = random.Random(seed)
        return task, [corrupt_prompt(e.prompt, rng) for e in task.eval]
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"behaviour {spec!r}: not a built-in task nor a JSONL file")
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    lines = lines[:n]
    examples = [Example(str(r["prompt"]), str(r["completion"])) for r in lines]
    corrupt = [r.get("counterfactual") for r in lines]
    return Task(path.stem, train=[], eval=examples), corrupt


def encode_behaviour(
    tokenizer: Any, examples: list[Example], corrupt: list[str | None], max_length: int
) -> tuple[Batch, Batch | None]:
    """The clean batch and, when every example has one of the same length, the corrupted one."""
    feats = [encode_example(tokenizer, e, max_length) for e in examples]
    pad = tokenizer.pad_token_id
    batch = {k: v.to(device()) for k, v in collate(feats, pad).items()}
    if any(c is None for c in corrupt):
        return batch, None
    bad = [
        encode_example(tokenizer, Example(str(c), e.completion), max_length)
        for c, e in zip(corrupt, examples, strict=True)
    ]
    if [len(f["input_ids"]) for f in bad] != [len(f["input_ids"]) for f in feats]:
        return batch, None
    return batch, {k: v.to(device()) for k, v in collate(bad, pad).items()}


EffectsKind = Literal["exact", "attribution"]
LOGIT_BUDGET = 2**28  # float32 logits per effects pass (1 GiB), before log-softmax copies


def fitting_chunk(model: nn.Module, batch: Batch, chunk: int | None) -> int:
    """Masks per effects pass: at most ``chunk``, and few enough that the tiled batch's logits
    stay within ``LOGIT_BUDGET`` elements (a large vocabulary needs small chunks)."""
    rows, tokens = batch["labels"].shape[0], completion_window(batch["labels"])
    vocab = int(getattr(model.config, "vocab_size", 1))
    fit = max(1, LOGIT_BUDGET // (rows * tokens * vocab))
    return min(chunk, fit) if chunk else fit


def analyse(
    model: nn.Module,
    batch: Batch,
    corrupt: Batch | None,
    kind: Literal["mean", "corrupt"],
    dbm: DBMSettings,
    chunk: int | None,
    effects_kind: EffectsKind = "exact",
) -> dict[str, Any]:
    """One model's circuit (DBM), its behaviour values, and every head's effects (exact, or
    to first order with ``attribution``: two backward passes instead of ``2N + 2`` forwards)."""
    if kind == "corrupt" and corrupt is None:
        raise ForgetlessError("--counterfactual corrupt: corrupted prompts change token length")
    cf = counterfactual(model, batch, kind, corrupt)
    torch.manual_seed(dbm.seed)
    result = train_masks(
        model,
        batch,
        cf,
        dbm.steps,
        dbm.lr,
        dbm.temperature,
        dbm.sparsity,
        final_temperature=dbm.final_temperature,
        straight_through=dbm.straight_through,
    )
    if effects_kind == "attribution":
        effects = head_effects_attribution(model, batch, cf)
    else:
        effects = head_effects(model, batch, cf, fitting_chunk(model, batch, chunk))
    return {
        "cf": cf,
        "probs": result.probs.cpu(),
        "binary": result.binary.cpu(),
        "mask_gap": result.gap,
        "m_full": effects.full,
        "m_empty": effects.empty,
        "m_circuit": behaviour(model, batch, result.binary.float(), cf),
        "necessity": effects.necessity,
        "sufficiency": effects.sufficiency,
        "forward_passes": {"dbm": result.forward_passes, "effects": effects.forward_passes},
    }


def _row(label: str, a: dict[str, Any], base: dict[str, Any] | None, th: Thresholds) -> dict:
    row: dict[str, Any] = {
        "model": label,
        "circuit_size": cm.circuit_size(a["binary"]),
        "circuit_fraction": cm.circuit_fraction(a["binary"]),
        "faithfulness": cm.faithfulness(a["m_circuit"], a["m_empty"], a["m_full"]),
        "mask_gap": a["mask_gap"],
        "m_full": a["m_full"],
        "m_empty": a["m_empty"],
        "m_circuit": a["m_circuit"],
        "specialists": cm.critical_specialists(
            a["necessity"], a["sufficiency"], a["m_full"], a["m_empty"], th.specialist
        ),
        "mask": a["probs"].tolist(),
        "circuit": a["binary"].int().tolist(),
        "necessity": a["necessity"].tolist(),
        "sufficiency": a["sufficiency"].tolist(),
        "forward_passes": a["forward_passes"],
    }
    row["n_specialists"] = len(row["specialists"])
    if base is not None:
        shifts = cm.mask_shifts(base["probs"], a["probs"], th.shift)
        row["retention"] = cm.retention(base["binary"], a["binary"])
        row["shift_counts"] = shifts.counts
        row["mask_shift"] = shifts.delta.tolist()
        row["preserved_heads"] = int((base["binary"] & a["binary"]).sum())
    return row


def diagnose_circuits(
    checkpoints: list[Path],
    behaviour_spec: str,
    out: Path,
    n: int = 16,
    seed: int = 0,
    kind: Literal["mean", "corrupt"] = "mean",
    dbm: DBMSettings | None = None,
    thresholds: Thresholds | None = None,
    chunk: int | None = 64,
    max_length: int = 64,
    effects: EffectsKind = "exact",
) -> dict[str, Any]:
    """Circuits of every checkpoint against the first (the base); JSON, Markdown and plots."""
    from forgetless.core.ownership import check_output_file, write_output_file
    from forgetless.core.storage import atomic_write_text

    pictures = [out.with_name(f"{out.stem}_{p}.png") for p in ("masks", "retention")]
    check_output_file(out, "circuits", "circuits.json", [out.with_suffix(".md"), *pictures])
    dbm, th = dbm or DBMSettings(), thresholds or Thresholds()
    task, corrupt_prompts = behaviour_task(behaviour_spec, n, seed)
    labels = checkpoint_labels(checkpoints)
    rows: list[dict[str, Any]] = []
    analyses: list[dict[str, Any]] = []
    for label, folder in zip(labels, checkpoints, strict=True):
        model, tokenizer = load_checkpoint(folder)
        batch, corrupt = encode_behaviour(tokenizer, task.eval, corrupt_prompts, max_length)
        a = analyse(model, batch, corrupt, kind, dbm, chunk, effects)
        base = analyses[0] if analyses else None
        row = _row(label, a, base, th)
        preserved = a["binary"] if base is None else base["binary"] & a["binary"]
        m_preserved = behaviour(model, batch, preserved.float().to(device()), a["cf"])
        row["dcm"] = cm.dcm_score(m_preserved, a["m_empty"])
        rows.append(row)
        analyses.append(a)
        del model
    data = {
        "schema_version": 1,
        "behaviour": task.name,
        "examples": len(task.eval),
        "counterfactual": kind,
        "effects": effects,
        "checkpoints": [str(c) for c in checkpoints],
        "dbm": dbm.__dict__,
        "thresholds": th.__dict__,
        "rows": rows,
        "vulnerability": _vulnerability(labels, analyses, th.vulnerability),
    }
    data["plots"] = {
        "masks": str(plot_masks(rows, pictures[0])),
        "retention": str(plot_retention(rows, pictures[1])),
    }
    write_output_file(out, "circuits", data)
    atomic_write_text(out.with_suffix(".md"), markdown_table(data))
    return data


def checkpoint_labels(checkpoints: list[Path]) -> list[str]:
    """Folder names, prefixed by their parent's where two would clash."""
    names = [c.name for c in checkpoints]
    return [f"{c.parent.name}/{c.name}" if names.count(c.name) > 1 else c.name for c in checkpoints]


def _vulnerability(
    labels: list[str], analyses: list[dict[str, Any]], delta: float
) -> list[dict[str, Any]]:
    """SFT vs RL at the same epoch (labels ``sft-epoch-E`` and ``rl-epoch-E``), within the base
    circuit: a = SFT, b = RL, so ``a_vulnerable`` heads are SFT-vulnerable."""
    by_label = {}
    for label, a in zip(labels, analyses, strict=True):
        match = EPOCH_LABEL.match(label.split("/")[-1])
        if match:
            by_label[(match.group(1), int(match.group(2)))] = a
    out = []
    for (kind, epoch), sft in sorted(by_label.items()):
        rl = by_label.get(("rl", epoch))
        if kind != "sft" or rl is None:
            continue
        v = cm.differential_vulnerability(sft["probs"], rl["probs"], delta, analyses[0]["binary"])
        out.append(
            {
                "epoch": epoch,
                "a": f"sft-epoch-{epoch}",
                "b": f"rl-epoch-{epoch}",
                "overall": v.overall,
                "per_layer": v.per_layer,
                "labels": v.labels,
            }
        )
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


TABLE_COLUMNS = (
    "model",
    "circuit_size",
    "circuit_fraction",
    "faithfulness",
    "retention",
    "dcm",
    "n_specialists",
    "m_full",
    "m_empty",
)


def markdown_table(data: dict[str, Any]) -> str:
    lines = [
        f"# Circuits on `{data['behaviour']}` ({data['examples']} examples, "
        f"{data['counterfactual']} counterfactual, {data['effects']} head effects)",
        "",
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|" + "---|" * len(TABLE_COLUMNS),
    ]
    for row in data["rows"]:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in TABLE_COLUMNS) + " |")
    for v in data["vulnerability"]:
        o = v["overall"]
        lines.append(
            f"\nEpoch {v['epoch']}, base-circuit heads {int(o['heads'])}: SFT-vulnerable "
            f"{int(o['a_vulnerable'])}, RL-vulnerable {int(o['b_vulnerable'])}, neutral "
            f"{int(o['neutral'])} (mean m_RL − m_SFT {o['mean_score']:.3f})"
        )
    return "\n".join(lines) + "\n"


def _save(fig: Any, path: Path, tight: bool = True) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{temp_file_name(path)}.png")  # savefig picks the format from the suffix
    if tight:
        fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def plot_masks(rows: list[dict[str, Any]], path: Path) -> Path:
    """One heat map (layer × head, DBM mask value) per model, circuit heads dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(rows), figsize=(2.6 * len(rows) + 1, 3.4), squeeze=False, layout="constrained"
    )
    for ax, row in zip(axes[0], rows, strict=True):
        mask = torch.tensor(row["mask"])
        image = ax.imshow(mask.numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto")
        layers, heads = torch.tensor(row["circuit"]).nonzero(as_tuple=True)
        ax.scatter(heads.numpy(), layers.numpy(), s=6, c="white")
        ax.set_xticks(range(mask.size(1)))
        ax.set_yticks(range(mask.size(0)))
        ax.set_title(row["model"], fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="mask")
    return _save(fig, path, tight=False)


def _per_checkpoint(ax: Any, rows: list[dict[str, Any]]) -> None:
    names = [row["model"].split("/")[-1] for row in rows]
    ax.plot(range(len(rows)), [row["retention"] for row in rows], marker="o")
    ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=7)
    ax.set_xlabel("checkpoint")


def plot_retention(rows: list[dict[str, Any]], path: Path) -> Path:
    """Base-circuit retention per epoch, one line per objective (SFT, RL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 3.4))
    for kind in ("sft", "rl"):
        pts = sorted(
            (int(m.group(2)), row["retention"])
            for row in rows
            if (m := EPOCH_LABEL.match(row["model"].split("/")[-1]))
            and m.group(1) == kind
            and row.get("retention") is not None
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kind.upper())
    if ax.get_lines():
        ax.set_xlabel("epoch of the objective (RL starts from the last SFT epoch)")
    else:  # checkpoints not named by epoch: one point per checkpoint, in the order given
        _per_checkpoint(ax, [r for r in rows if r.get("retention") is not None])
    ax.set_ylabel("base-circuit retention")
    ax.set_ylim(0, 1.05)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return _save(fig, path)
