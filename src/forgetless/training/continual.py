"""Bring your own model and data: a continual run of a loaded model on in-memory tasks.

    trainer = ContinualTrainer(model, tokenizer, [("math", ds_math), ("chat", ds_chat)],
                               method="ewc", probes=["copy"], steps=100, lr=1e-4)
    results = trainer.fit()            # the accuracy matrix, BWT/FWT, retention, KL

The tasks' data are saved as JSONL under the run folder's ``data/``, and the run is an ordinary
forgetless run of the config written beside them: ``forgetless run OUT/config.yaml --out NEW``
repeats it from the saved data (with the model read from its ``name_or_path``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from forgetless.config.loading import validate_config
from forgetless.config.schema import TASK_NAME, RunConfig
from forgetless.core.ownership import check_output_folder, mark_folder
from forgetless.core.storage import atomic_write_text
from forgetless.errors import ConfigError, DataError
from forgetless.training.results import Results
from forgetless.training.runner import DATA_DIR, Runner

EVAL_SPLITS = ("test", "validation", "eval")
"""The split of a ``DatasetDict`` used for evaluation, the first one present."""


def _rows(data: Any, where: str) -> list[dict[str, Any]]:
    """A ``datasets.Dataset`` or a list of dicts as a list of JSON-able records."""
    rows = data.to_list() if hasattr(data, "to_list") else list(data)
    if not rows:
        raise DataError(f"{where}: no examples")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, Mapping)), None)
    if bad is not None:
        raise DataError(f"{where}: example {bad} is a {type(rows[bad]).__name__}, not a record")
    return [dict(r) for r in rows]


def _splits(data: Any, where: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Training records, and evaluation records when a ``DatasetDict`` holds an eval split."""
    if isinstance(data, Mapping) and "train" in data:
        held = next((data[s] for s in EVAL_SPLITS if s in data), None)
        return _rows(data["train"], f"{where}.train"), held and _rows(held, f"{where}.eval")
    return _rows(data, where), None


def _adapter(model: Any) -> Any:
    """The LoRA config of a ``PeftModel``'s active adapter, or None for a plain model."""
    configs = getattr(model, "peft_config", None)
    return configs.get(getattr(model, "active_adapter", None)) if configs else None


def _with_adapter(finetune: dict[str, Any], model: Any) -> dict[str, Any]:
    """``finetune`` for a ``PeftModel``: LoRA in regime ``carry`` on its own adapter."""
    adapter = _adapter(model)
    if adapter is None:
        return finetune
    where = "ContinualTrainer: finetune"
    lora = dict(finetune.get("lora") or {})
    if finetune.get("mode") != "lora" or lora.get("regime", "carry") != "carry":
        raise ConfigError(
            f"{where}: a PeftModel trains its own adapter (LoRA, regime carry); "
            "call merge_and_unload() on it first for full fine-tuning or another regime"
        )
    targets = adapter.target_modules
    if isinstance(targets, str):
        raise ConfigError(f"{where}: the adapter's target_modules is a pattern ({targets!r})")
    lora.update(
        r=adapter.r, alpha=adapter.lora_alpha, dropout=adapter.lora_dropout,
        target_modules=sorted(targets), regime="carry",
    )  # fmt: skip
    if adapter.layers_to_transform is not None:
        lora["layers"] = list(adapter.layers_to_transform)
    return {**finetune, "lora": lora}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    lines = [json.dumps(r, ensure_ascii=False, default=str) for r in rows]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


class ContinualTrainer:
    """Teaches ``model`` the ``tasks`` in order with ``method``; measures what it keeps.

    ``tasks`` and data ``probes`` are ``(name, data)`` pairs, where data is a
    ``datasets.Dataset``, a ``DatasetDict`` (``train`` plus ``test``/``validation``) or a list of
    dicts, each in prompt/completion or chat ``messages`` form; a probe may also be a built-in
    name. ``method`` is a name or a ``{name: ..., options}`` mapping; ``finetune`` is ``full``
    (the default), ``lora`` or a ``finetune:`` mapping. A ``peft.PeftModel`` trains its own
    active adapter across the tasks (LoRA, regime ``carry``, its rank and targets); its
    "before" is the model as given, adapter included, while a method's frozen reference
    (KL-SFT's) is loaded from its ``name_or_path``, without the adapter. ``evaluation`` is an
    ``eval:`` mapping; every other keyword is a ``train:`` setting (``steps``, ``lr``,
    ``batch_size``, ``max_length`` ...).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        tasks: Sequence[tuple[str, Any]],
        method: str | Mapping[str, Any] = "seq_ft",
        *,
        probes: Sequence[str | tuple[str, Any]] = (),
        finetune: str | Mapping[str, Any] | None = None,
        evaluation: Mapping[str, Any] | None = None,
        out_dir: str | Path = "runs/continual",
        seed: int = 0,
        progress: bool = True,
        console: Console | None = None,
        **train: Any,
    ) -> None:
        if not tasks:
            raise ConfigError("ContinualTrainer: tasks: give at least one (name, data) pair")
        self.model, self.tokenizer = model, tokenizer
        self.tasks, self.probes = list(tasks), list(probes)
        self.method, self.finetune, self.evaluation = method, finetune, dict(evaluation or {})
        self.out_dir, self.seed, self.train = Path(out_dir), seed, train
        self.progress, self.console = progress, console or Console()

    def fit(self) -> Results:
        """Save the data, write the config, and run (resuming a run already in ``out_dir``)."""
        check_output_folder(self.out_dir, "run")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        mark_folder(self.out_dir, "run")
        cfg = self.config()
        runner = Runner(cfg, self.out_dir, self.console, progress=self.progress)
        runner.loaded = (self.model, self.tokenizer)
        return runner.run()

    def config(self) -> RunConfig:
        """The run's config, its tasks' data saved under ``out_dir/data``."""
        mode = self.finetune or ("lora" if _adapter(self.model) else "full")
        finetune = {"mode": mode} if isinstance(mode, str) else dict(mode)
        data = {
            "seed": self.seed,
            "model": {"name_or_path": self._model_source()},
            "finetune": _with_adapter(finetune, self.model),
            "train": self.train,
            "eval": self.evaluation,
            "tasks": [self._task(name, d, "tasks") for name, d in self.tasks],
            "probes": [p if isinstance(p, str) else self._task(*p, "probes") for p in self.probes],
            "method": self.method if isinstance(self.method, str) else dict(self.method),
        }
        return validate_config(data, "ContinualTrainer")

    def _model_source(self) -> str:
        source = getattr(self.model, "name_or_path", "") or ""
        if not source:
            raise ConfigError(
                "ContinualTrainer: model: it has no name_or_path, so the run's config could not "
                "name it; load it with from_pretrained, or set model.name_or_path to its folder"
            )
        return str(source)

    def _task(self, name: str, data: Any, section: str) -> dict[str, Any]:
        where = f"ContinualTrainer: {section}: {name!r}"
        if not TASK_NAME.fullmatch(name):
            raise ConfigError(f"{where}: not usable as a file name (letters, digits, _ . + = @ -)")
        train, held = _splits(data, where)
        folder = self.out_dir / DATA_DIR
        source: dict[str, Any] = {"train": str(_write_jsonl(folder / f"{name}.jsonl", train))}
        if held:
            source["eval"] = str(_write_jsonl(folder / f"{name}.eval.jsonl", held))
        return {"name": name, "jsonl": source}
