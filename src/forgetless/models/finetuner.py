"""What is trained across the sequence: all weights, or LoRA adapters in one of three regimes.

- ``carry``: one adapter for the whole sequence (SeqLoRA);
- ``merge``: a new adapter per task, merged into the weights when the task ends;
- ``per_task``: a new adapter per task; past adapters stay active but frozen (as O-LoRA needs).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_model, save_file, save_model
from torch import nn

from forgetless.config.schema import FinetuneConfig
from forgetless.core import sharding
from forgetless.core.storage import check_fits, read_tensors, tensor_shapes
from forgetless.core.tensor_files import ADAPTER_FILE, WEIGHTS_FILE
from forgetless.errors import CheckpointError, ModelLoadError


@contextmanager
def peft_quiet() -> Iterator[None]:
    """Silence the FutureWarning that PEFT's model constructor triggers under transformers 5 (it
    reads ``is_gradient_checkpointing``): a user cannot act on it, and it came with every LoRA
    run."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


class Finetuner:
    """Owns the trained model object across tasks and knows how to save and restore it."""

    def __init__(self, model: nn.Module, cfg: FinetuneConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.adapters: list[str] = []
        """The live adapters (active; the last one trains)."""
        self.attached: list[str] = list(getattr(model, "peft_config", {}))
        """Every adapter in the model, live or not yet (a sharded ``per_task`` run attaches
        them all before the split); a model that came as a ``PeftModel`` brings its own."""
        self.carried = str(getattr(model, "active_adapter", "default"))
        """The ``carry`` regime's one adapter: a ``PeftModel``'s active one, else "default"."""
        if self.is_lora:
            check_lora_targets(model, cfg.lora.target_modules)

    @property
    def is_lora(self) -> bool:
        return self.cfg.mode == "lora"

    def _peft_config(self) -> PeftLoraConfig:
        lora = self.cfg.lora
        return PeftLoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            layers_to_transform=list(lora.layers) if lora.layers is not None else None,
            task_type="CAUSAL_LM",
        )

    def _attach(self, name: str) -> None:
        if isinstance(self.model, PeftModel):
            self.model.add_adapter(name, self._peft_config())
        else:
            with peft_quiet():
                self.model = get_peft_model(self.model, self._peft_config(), adapter_name=name)
        self.attached.append(name)
        # only live adapters take part in the forward pass (before task 1, the first: B = 0)
        self._activate(list(self.adapters) or self.attached[:1])

    def _activate(self, names: list[str]) -> None:
        assert isinstance(self.model, PeftModel)
        self.model.base_model.set_adapter(names)  # type: ignore[operator]

    def _add_adapter(self, name: str) -> None:
        if name not in self.attached:
            self._attach(name)
        self.adapters.append(name)
        self._activate(list(self.adapters))
        self._train_only(name)

    def _train_only(self, name: str) -> None:
        for param_name, param in self.model.named_parameters():
            param.requires_grad = f".{name}." in param_name and "lora_" in param_name

    def tasks_attached_before_split(self, n_tasks: int) -> list[int]:
        """The tasks whose adapters a sharded run attaches before the model is split (FSDP2
        shards an adapter only with its layer): the ``carry`` regime's one adapter (task 1's)
        or every ``per_task`` adapter; the ``merge`` regime cannot run sharded."""
        if not self.is_lora:
            return []
        regime = self.cfg.lora.regime
        if regime == "carry":
            return [1]
        return list(range(1, n_tasks + 1)) if regime == "per_task" else []

    def attach_before_split(self, index: int) -> None:
        """Attach task ``index``'s adapter before the split (B = 0: the outputs are unchanged).
        A ``per_task`` adapter stays out of the forward pass until its task begins."""
        if self.cfg.lora.regime == "carry":
            if not self.adapters:
                self._add_adapter(self.carried)
        elif f"task_{index}" not in self.attached:
            self._attach(f"task_{index}")

    def begin_task(self, index: int) -> None:
        """Prepare the trainable parameters for task ``index`` (1-based)."""
        if not self.is_lora:
            return
        regime = self.cfg.lora.regime
        if regime == "per_task":
            self._add_adapter(f"task_{index}")
        elif regime == "merge":
            self._add_adapter("default")
        elif not self.adapters:
            self._add_adapter(self.carried)

    def save(self, folder: Path) -> None:
        """Full weights, or each live adapter under ``adapters/<name>/`` in PEFT's layout."""
        if not self.is_lora:
            if sharding.is_sharded(self.model):  # gathered to the main process, written there
                state = sharding.full_state(self.model)
                if state is not None:
                    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
                return
            save_model(self.model, str(folder / WEIGHTS_FILE))
            return
        assert isinstance(self.model, PeftModel)
        for name in self.adapters:
            target = folder / "adapters" / name
            target.mkdir(parents=True)
            state = get_peft_model_state_dict(self.model, adapter_name=name)
            whole = {k: sharding.replicated(v).cpu().contiguous() for k, v in state.items()}
            save_file(whole, str(target / ADAPTER_FILE))
            self.model.peft_config[name].save_pretrained(str(target))

    def end_task(self) -> None:
        """In the ``merge`` regime, fold the task's adapter into the weights."""
        if self.is_lora and self.cfg.lora.regime == "merge":
            assert isinstance(self.model, PeftModel)
            self.model = self.model.merge_and_unload()
            self.adapters, self.attached = [], []

    def restore(self, checkpoints: list[Path]) -> None:
        """Rebuild the state after the tasks whose checkpoints are given (in order)."""
        if not checkpoints:
            return
        if not self.is_lora:
            path = checkpoints[-1] / WEIGHTS_FILE
            check_fits(path, tensor_shapes(path), self.model)
            if sharding.is_sharded(self.model):
                sharding.load_full_state(self.model, read_tensors(path), str(path))
                return
            try:
                load_model(self.model, str(path))
            except RuntimeError as err:  # e.g. tensors the model has but the file lacks
                why = " ".join(str(err).split())  # the missing names come after the first line
                raise CheckpointError(f"{path}: {why}") from None
            return
        if self.cfg.lora.regime == "merge":
            for index, ckpt in enumerate(checkpoints, start=1):
                self.begin_task(index)
                self._load_adapter("default", ckpt)
                self.end_task()
            return
        names = sorted(p.name for p in (checkpoints[-1] / "adapters").iterdir())
        for name in sorted(names, key=_adapter_order):
            if name not in self.adapters:
                self._add_adapter(name)
            self._load_adapter(name, checkpoints[-1])

    def _load_adapter(self, name: str, ckpt: Path) -> None:
        path = ckpt / "adapters" / name / ADAPTER_FILE
        state = read_tensors(path)
        if sharding.is_sharded(self.model):
            self._load_adapter_shards(name, state, path)
            return
        try:
            set_peft_model_state_dict(self.model, state, adapter_name=name)
        except RuntimeError as err:  # size mismatch: an adapter of another model or rank
            raise CheckpointError(
                f"{path}: does not fit the model ({str(err).splitlines()[-1].strip()})"
            ) from None

    def _load_adapter_shards(self, name: str, state: dict[str, torch.Tensor], path: Path) -> None:
        """A whole saved adapter into a sharded model: each process keeps its part of each
        tensor (PEFT's loader would copy whole tensors into the shards)."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for key, value in state.items():
                param = params.get(adapter_parameter(key, name))
                if param is None or tuple(param.shape) != tuple(value.shape):
                    raise CheckpointError(f"{path}: {key} does not fit the model's adapter {name}")
                sharding.local(param).copy_(sharding.local(sharding.split_like(value, param)))


def check_lora_targets(model: nn.Module, targets: list[str]) -> None:
    """Every LoRA target name must match a module of ``model`` (PEFT's name-suffix rule)."""
    if targets == ["all-linear"]:
        return
    names = [n for n, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        leaves = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if not list(m.children())}
        )
        raise ModelLoadError(
            f"finetune.lora.target_modules: {', '.join(map(repr, missing))} not in the model "
            f"(its leaf modules: {', '.join(leaves)})"
        )


def _adapter_order(name: str) -> tuple[int, str]:
    suffix = name.rsplit("_", 1)[-1]
    return (int(suffix) if suffix.isdigit() else -1, name)


def adapter_parameter(key: str, name: str) -> str:
    """The parameter a saved adapter tensor belongs to: PEFT saves ``…lora_A.weight``, the
    model names it ``…lora_A.<adapter>.weight``."""
    for part in ("lora_A", "lora_B"):
        key = key.replace(f".{part}.weight", f".{part}.{name}.weight")
    return key
