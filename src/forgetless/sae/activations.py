"""Last-layer MLP outputs of a causal LM: the hook, collection over data, and the SAE cache.

The hook sits on the ``mlp`` of the last decoder layer (``...layers.<last>.mlp``), found by name,
so the same code works on a plain Hugging Face model and on one wrapped by PEFT (where LoRA
adapters inside the MLP are part of what the hook sees).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from forgetless.core.storage import atomic_dir, cache_fill_lock
from forgetless.errors import ConfigError
from forgetless.sae.gated import WEIGHTS_FILE, GatedSAE, load_sae, read_sae_record, save_sae
from forgetless.sae.train import SAETrainConfig, sae_metrics, train_sae
from forgetless.tasks.base import Example
from forgetless.tasks.formatting import Features, collate, encode_example

_LAYER_MLP = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp$")


def last_mlp(model: nn.Module) -> nn.Module:
    """The ``mlp`` module of the model's last decoder layer."""
    found = [
        (int(m.group(1)), mod)
        for name, mod in model.named_modules()
        if (m := _LAYER_MLP.search(name))
    ]
    if not found:
        raise ConfigError("no '<...>.layers.<i>.mlp' module in the model: cannot hook its MLP")
    return max(found, key=lambda item: item[0])[1]


class StopForward(Exception):
    """Raised by an armed tap once it has the MLP output: the rest of the forward is skipped."""


class MLPTap:
    """A forward hook on the last MLP. Idle unless armed by ``run``, which keeps the MLP output
    (with its graph, when gradients are on) and stops the forward pass right there, so the final
    norm, the LM head and the logits are never computed for it. With ``recording`` set it keeps
    the output of the next full forward instead (read it with ``take``), without stopping it."""

    def __init__(self) -> None:
        self.armed = False
        self.recording = False
        self.output: Tensor | None = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if not (self.armed or self.recording):
            return
        self.output = output[0] if isinstance(output, tuple) else output
        if self.armed:
            raise StopForward

    def take(self) -> Tensor:
        """The recorded output of the last forward (``recording``); stops recording."""
        out, self.output, self.recording = self.output, None, False
        if out is None:
            raise RuntimeError("the MLP hook recorded nothing: is it registered on this model?")
        return out

    def register(self, model: nn.Module) -> RemovableHandle:
        return last_mlp(model).register_forward_hook(self)

    def run(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The last MLP's output ``(batch, length, d)`` for these inputs."""
        self.armed, self.output = True, None
        try:
            model(input_ids=input_ids, attention_mask=attention_mask)
        except StopForward:
            pass
        finally:
            self.armed = False
        out, self.output = self.output, None
        if out is None:
            raise RuntimeError("the MLP hook did not fire: is it registered on this model?")
        return out


def later_tokens(mask: Tensor) -> Tensor:
    """For the non-padding tokens of a right-padded ``mask``, in row order: False at each row's
    first token, True elsewhere (``SAETrainConfig.skip_first``)."""
    return mask.bool().cumsum(1)[mask.bool()] > 1


def token_outputs(
    tap: MLPTap, model: nn.Module, batch: dict[str, Tensor], skip_first: bool = False
) -> Tensor:
    """The MLP outputs at the non-padding positions of ``batch``, row by row: ``(tokens, d)``;
    without each row's first token if ``skip_first``."""
    h = tap.run(model, batch["input_ids"], batch["attention_mask"])
    tokens = h[batch["attention_mask"].bool()]
    return tokens[later_tokens(batch["attention_mask"])] if skip_first else tokens


@torch.no_grad()
def collect_mlp_outputs(
    model: nn.Module,
    features: Sequence[Features],
    pad_id: int,
    device: torch.device,
    batch_size: int = 32,
    dtype: torch.dtype = torch.float32,
    skip_first: bool = False,
) -> Tensor:
    """Last-MLP outputs of every non-padding token of ``features`` (but each example's first,
    if ``skip_first``), in order, on the CPU."""
    tap = MLPTap()
    handle = tap.register(model)
    was_training = model.training
    model.eval()
    parts: list[Tensor] = []
    try:
        for lo in range(0, len(features), batch_size):
            batch = {
                k: v.to(device)
                for k, v in collate(list(features[lo : lo + batch_size]), pad_id).items()
            }
            parts.append(token_outputs(tap, model, batch, skip_first).to("cpu", dtype))
    finally:
        handle.remove()
        model.train(was_training)
    if not parts:
        raise ValueError("collect_mlp_outputs needs at least one example")
    return torch.cat(parts)


# --- the data an SAE is trained on --------------------------------------------------------------


def sae_examples(
    sources: list[str | dict[str, Any]] | None, n: int, seed: int, split: str = "train"
) -> dict[str, list[Example]]:
    """Examples per source: built-in task names or run-config task entries (null: all built-ins).

    ``split`` is ``train`` or ``eval``; the held-out eval split is what ``sae eval`` reports on.
    """
    from forgetless.config.schema import EvalConfig, TaskConfig
    from forgetless.tasks.builtin import BUILTIN_TASKS
    from forgetless.tasks.loaders import build_task

    entries: list[str | dict[str, Any]] = list(sources) if sources else list(BUILTIN_TASKS)
    out: dict[str, list[Example]] = {}
    for entry in entries:
        task_cfg = TaskConfig.model_validate(entry)
        task = build_task(task_cfg, EvalConfig.model_validate({"n_eval": n, "n_train": n}), seed)
        out[task.name] = list(task.train if split == "train" else task.eval)
    return out


def default_sae_sources(sequence: list[str]) -> list[str]:
    """What an SAE reads when its sources are not given: the base's general data, never the
    run's own tasks. For a sequence of instruct tasks, the instruct tasks outside it; otherwise
    the tiny suite's built-in tasks outside it (the base's pretraining skills among them)."""
    from forgetless.tasks.builtin import BUILTIN_TASKS
    from forgetless.tasks.instruct import INSTRUCT_TASKS

    pool = INSTRUCT_TASKS if any(name in INSTRUCT_TASKS for name in sequence) else BUILTIN_TASKS
    return [name for name in pool if name not in sequence]


def example_features(
    examples: dict[str, list[Example]], tokenizer: Any, max_length: int
) -> list[Features]:
    return [encode_example(tokenizer, e, max_length) for ex in examples.values() for e in ex]


def model_fingerprint(model: nn.Module, tokenizer: Any) -> str:
    """A short hash of a model's weights (names, shapes and a strided sample of each tensor) and
    its tokenizer's size: the same base model gives the same fingerprint without hashing every
    byte of a large checkpoint."""
    digest = hashlib.sha256()
    digest.update(f"{type(tokenizer).__name__}:{len(tokenizer)}".encode())
    with torch.no_grad():
        for name, param in model.state_dict().items():
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)][:4096].float().cpu()
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def sae_key(fingerprint: str, cfg: SAETrainConfig, max_length: int) -> str:
    payload = {"model": fingerprint, "sae": cfg.key_fields(), "max_length": max_length}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def shared_sae_dir(fingerprint: str, cfg: SAETrainConfig, max_length: int) -> Path:
    """Where the SAE of this base model and settings is cached (``$FORGETLESS_CACHE/sae/...``)."""
    from forgetless.core.paths import cache_root

    return cache_root() / "sae" / sae_key(fingerprint, cfg, max_length)


@dataclass
class TrainedSAE:
    sae: GatedSAE
    folder: Path
    trained: bool
    """False when it was loaded from ``folder`` rather than trained now."""
    record: dict[str, Any]


def fit_sae(
    model: nn.Module,
    tokenizer: Any,
    cfg: SAETrainConfig,
    max_length: int,
    device: torch.device,
    on_step: Callable[[float], None] | None = None,
) -> tuple[GatedSAE, dict[str, Any]]:
    """Collect last-MLP outputs of ``model`` on the configured sources and train a gated SAE.

    Returns the SAE and a JSON record: the settings, the data sizes, the loss history and the
    metrics on the training activations and on the sources' held-out eval split.
    """
    pad_id = tokenizer.pad_token_id
    train_ex = sae_examples(cfg.tasks, cfg.n_per_task, cfg.seed, "train")
    eval_ex = sae_examples(cfg.tasks, cfg.n_per_task, cfg.seed, "eval")
    with cfg.precision(device):
        train_acts, eval_acts = [
            collect_mlp_outputs(
                model,
                example_features(examples, tokenizer, max_length),
                pad_id,
                device,
                skip_first=cfg.skip_first,
            )
            for examples in (train_ex, eval_ex)
        ]
    sae, history = train_sae(train_acts, cfg, device, on_step)
    record = {
        "train": cfg.model_dump(mode="json"),
        "max_length": max_length,
        "sources": {name: len(ex) for name, ex in train_ex.items()},
        "train_tokens": int(train_acts.size(0)),
        "history": history,
        "metrics": {
            "train": sae_metrics(sae, train_acts).as_dict(),
            "eval": sae_metrics(sae, eval_acts).as_dict(),
        },
    }
    return sae, record


def ensure_sae(
    folder: Path,
    load_base: Callable[[], nn.Module],
    tokenizer: Any,
    cfg: SAETrainConfig,
    max_length: int,
    device: torch.device,
) -> TrainedSAE:
    """The SAE saved in ``folder``, or one trained now on ``load_base()`` and saved there."""
    with cache_fill_lock(folder):
        if (folder / WEIGHTS_FILE).is_file():
            return TrainedSAE(load_sae(folder, device), folder, False, read_sae_record(folder))
        base = load_base().to(device)  # type: ignore[arg-type]
        sae, record = fit_sae(base, tokenizer, cfg, max_length, device)
        del base
        folder.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(folder) as tmp:
            save_sae(sae, tmp, record)
    return TrainedSAE(sae, folder, True, read_sae_record(folder))
