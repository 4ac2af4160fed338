"""Bring your own model and data: a continual run of a loaded model on in-memory tasks.

    trainer = ContinualTrainer(model, tokenizer, [("math", ds_math), ("chat", ds_chat)],
                               method="ewc", probes=["copy"], steps=100, lr=1e-4)
    results = trainer.fit()            # the accuracy matrix, BWT/FWT, retention, KL

The tasks' data are saved as JSONL under the run folder's ``data/``, and the run is an ordinary
forgetless run of the config written beside them: ``forgetless run OUT/config.yaml --out NEW``
repeats it from the saved data (with the model read from its ``name_or_path``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from forgetless.config.evaluation import LMEVAL_PREFIX
from forgetless.config.loading import validate_config
from forgetless.config.schema import TASK_NAME, Columns, RunConfig
from forgetless.core.ownership import check_output_folder, mark_folder
from forgetless.core.storage import atomic_write_text
from forgetless.errors import ConfigError, DataError
from forgetless.tasks.builtin import known_task_names, unknown_task
from forgetless.tasks.loaders import example_from_record
from forgetless.training.inputs import Fingerprint
from forgetless.training.results import Results
from forgetless.training.resume import API_REMEDIES, folder_has_trained, resume_check
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
    if isinstance(data, Mapping):
        if "train" not in data:
            raise DataError(
                f"{where}: a mapping of splits needs a 'train' split (has {', '.join(data)})"
            )
        held = next((data[s] for s in EVAL_SPLITS if s in data), None)
        return _rows(data["train"], f"{where}.train"), held and _rows(held, f"{where}.eval")
    return _rows(data, where), None


def _check_records(rows: list[dict[str, Any]], where: str) -> None:
    """Each record in a form a task reads (prompt/completion, chat, multiple choice), checked
    in memory so that a bad one is named by its task and row before anything is written."""
    for index, row in enumerate(rows):
        example_from_record(row, f"{where}: row {index}", Columns())


def _pairs(items: Sequence[Any], section: str, names_allowed: bool) -> list[Any]:
    """``items`` as given, each a ``(name, data)`` pair (or, for probes, a built-in name)."""
    if isinstance(items, Mapping):
        raise ConfigError(
            f"ContinualTrainer: {section}: a mapping; give a list of (name, data) pairs, "
            f"e.g. list({section}.items())"
        )
    for index, item in enumerate(items):
        if names_allowed and isinstance(item, str):
            if not item.startswith(LMEVAL_PREFIX) and item not in known_task_names():
                raise ConfigError(f"ContinualTrainer: {section}.{index}: {unknown_task(item)}")
            continue
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            got = type(item).__name__
            raise ConfigError(
                f"ContinualTrainer: {section}.{index}: expected a (name, data) pair, got {got}"
            )
    return list(items)


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


def _jsonl_text(rows: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(r, ensure_ascii=False, default=str) for r in rows) + "\n"


def _text_fingerprint(text: str) -> Fingerprint:
    """What ``inputs.fingerprint`` would record of ``text`` once written as a file."""
    data = text.encode("utf-8")
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _saved_text(path: Path) -> str | None:
    return path.read_text(encoding="utf-8") if path.is_file() else None


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
    ``batch_size``, ``max_length`` ...); a method's own options go in ``method``
    (``{"name": "ewc", "lam": 5e3}``). ``allow_config_change`` resumes a run in ``out_dir``
    with other data or settings and records the change (what the CLI's flag does).
    ``progress=False`` draws no bars: a plain progress line comes every 30 s instead
    (``FORGETLESS_PROGRESS_EVERY`` sets the seconds), as under the CLI's ``--quiet``.
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
        allow_config_change: bool = False,
        **train: Any,
    ) -> None:
        if not tasks:
            raise ConfigError("ContinualTrainer: tasks: give at least one (name, data) pair")
        self.model, self.tokenizer = model, tokenizer
        self.tasks, self.probes = _pairs(tasks, "tasks", False), _pairs(probes, "probes", True)
        self.method, self.finetune, self.evaluation = method, finetune, dict(evaluation or {})
        self.out_dir, self.seed, self.train = Path(out_dir), seed, train
        self.progress, self.console = progress, console or Console()
        self.allow_config_change = allow_config_change

    def fit(self) -> Results:
        """Save the data, write the config, and run (resuming a run already in ``out_dir``).

        Everything is checked before anything is written: the config, and, where ``out_dir``
        holds a run that has trained, that the data and config are the ones it began with (or
        ``allow_config_change``, recorded in its results)."""
        check_output_folder(self.out_dir, "run", place="out_dir")
        cfg, files = self.planned()
        self._check_resumable(cfg, files)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        mark_folder(self.out_dir, "run")
        self._save(files)
        runner = Runner(
            cfg, self.out_dir, self.console, progress=self.progress,
            allow_config_change=self.allow_config_change, remedies=API_REMEDIES,
        )  # fmt: skip
        runner.loaded = (self.model, self.tokenizer)
        return runner.run()

    def config(self) -> RunConfig:
        """The run's config, its tasks' data saved under ``out_dir/data``."""
        cfg, files = self.planned()
        self._save(files)
        return cfg

    def planned(self) -> tuple[RunConfig, dict[Path, str]]:
        """The run's config and the JSONL text of each data file it names; nothing written."""
        mode = self.finetune or ("lora" if _adapter(self.model) else "full")
        finetune = {"mode": mode} if isinstance(mode, str) else dict(mode)
        files: dict[Path, str] = {}
        data = {
            "seed": self.seed,
            "model": {"name_or_path": self._model_source()},
            "finetune": _with_adapter(finetune, self.model),
            "train": self.train,
            "eval": self.evaluation,
            "tasks": [self._task(name, d, "tasks", files) for name, d in self.tasks],
            "probes": [
                p if isinstance(p, str) else self._task(p[0], p[1], "probes", files)
                for p in self.probes
            ],
            "method": self.method if isinstance(self.method, str) else dict(self.method),
        }
        return validate_config(data, "ContinualTrainer"), files

    def _check_resumable(self, cfg: RunConfig, files: dict[Path, str]) -> None:
        """Refuse, before a byte is written, data or a config that the run in ``out_dir`` did
        not begin with: the saved files are the record of what it trained on."""
        if not self.allow_config_change and folder_has_trained(self.out_dir):
            for path, text in files.items():
                saved = _saved_text(path)
                if saved is not None and saved != text:
                    raise ConfigError(
                        f"ContinualTrainer: {path.name}: these data differ from {path}, which "
                        f"the run in {self.out_dir} trained on; pass the same data to resume "
                        "it, use another out_dir, or allow_config_change=True to go on and "
                        "record it"
                    )
        prints = {str(path): _text_fingerprint(text) for path, text in files.items()}
        resume_check(self.out_dir, cfg, self.allow_config_change, prints, API_REMEDIES)

    @staticmethod
    def _save(files: dict[Path, str]) -> None:
        """Each data file, unless it already holds the same text (a resume leaves it be)."""
        for path, text in files.items():
            if _saved_text(path) != text:
                atomic_write_text(path, text)

    def _model_source(self) -> str:
        source = getattr(self.model, "name_or_path", "") or ""
        if not source:
            raise ConfigError(
                "ContinualTrainer: model: it has no name_or_path, so the run's config could not "
                "name it; load it with from_pretrained, or set model.name_or_path to its folder"
            )
        return str(source)

    def _task(self, name: str, data: Any, section: str, files: dict[Path, str]) -> dict[str, Any]:
        """The task's config; its data's JSONL text goes into ``files`` by path."""
        where = f"ContinualTrainer: {section}: {name!r}"
        if not TASK_NAME.fullmatch(name):
            raise ConfigError(f"{where}: not usable as a file name (letters, digits, _ . + = @ -)")
        train, held = _splits(data, where)
        _check_records(train, where)
        if held:
            _check_records(held, f"{where} (eval)")
        folder = self.out_dir.resolve() / DATA_DIR  # the config then reads from any folder
        source: dict[str, Any] = {}
        for key, rows, path in (("train", train, folder / f"{name}.jsonl"),
                                ("eval", held, folder / f"{name}.eval.jsonl")):  # fmt: skip
            if rows:
                files[path] = _jsonl_text(rows)
                source[key] = str(path)
        return {"name": name, "jsonl": source}
