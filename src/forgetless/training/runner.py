"""The continual runner: loads the model and the tasks, then composes the parts that run them:
``TaskLoop`` (each task to its checkpoint), ``Evaluator`` (scores on the tasks and probes),
``ScaleOut`` (one process, DDP, FSDP2, ZeRO) and ``RunWriter`` (the folder and the screen)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from forgetless.config.schema import RunConfig, TaskConfig
from forgetless.contract.method import Capability, Method, create_method
from forgetless.core import distributed, registry
from forgetless.core.storage import remove_stale_temps
from forgetless.engine.budget import BudgetMonitor
from forgetless.engine.progress import Progress
from forgetless.errors import ConfigError
from forgetless.eval.evaluator import Evaluator
from forgetless.models.device import pick_device
from forgetless.models.finetuner import Finetuner
from forgetless.models.loading import load_model_and_tokenizer, lost_text_warning, resolve_source
from forgetless.tasks.base import Task
from forgetless.training.base_row import base_row_path, load_base_row, store_base_row
from forgetless.training.budget_probe import budget_measure, start_monitor
from forgetless.training.inputs import check_lm_eval_probes, fingerprints
from forgetless.training.outdir import OutDirLock
from forgetless.training.pretrain import ensure_base_model
from forgetless.training.results import Results
from forgetless.training.resume import Remedies, resume_check
from forgetless.training.run_writer import RunWriter
from forgetless.training.scale_out import ScaleOut, seed_everything, task_seed
from forgetless.training.startup import runtime, start_up
from forgetless.training.task_data import encode_remaining, load_tasks
from forgetless.training.task_loop import TaskLoop

__all__ = ["DATA_DIR", "Runner", "load_tasks", "seed_everything", "task_seed"]

DATA_DIR = "data"
"""A run folder's subfolder for the tasks' data that forgetless itself saved (in-memory data
given to ``ContinualTrainer``): read by the run, never written by it."""


@dataclass
class Runner:
    """Runs ``cfg`` into ``out_dir``; running again into the same folder resumes it."""

    cfg: RunConfig
    out_dir: Path
    console: Console = field(default_factory=Console)
    progress: bool = True
    allow_config_change: bool = False
    remedies: Remedies = field(default_factory=Remedies)
    """How a refusal to resume names the ways out (the CLI's flags by default)."""
    method: Method | None = None
    """A method instance to use instead of building one from ``cfg.method`` (tests, notebooks)."""
    loaded: tuple[nn.Module, Any] | None = None
    """A model and tokenizer already in memory, used instead of loading ``cfg.model``."""

    def run(self) -> Results:
        torch.set_flush_denormal(True)
        placed = distributed.start().device  # accelerate picks the process's device
        self.device = pick_device(self.cfg.device, placed, distributed.world_size())
        if not distributed.is_main_process():  # one process prints and writes
            self.console, self.progress = Console(quiet=True), False
        warning = distributed.launch_warning()
        if warning:
            self.console.print(warning, markup=False, highlight=False)
        self.inputs = fingerprints(self.cfg)
        check_lm_eval_probes(self.cfg)  # before the folder is claimed or anything written
        if not distributed.is_main_process():
            return self._run(self._resumable())
        own = (self.out_dir / DATA_DIR).resolve()  # data forgetless saved there (ContinualTrainer)
        inputs = [Path(p) for p in self.inputs if not Path(p).resolve().is_relative_to(own)]
        with OutDirLock(self.out_dir, "run", inputs):
            remove_stale_temps(self.out_dir)
            return self._run(self._resumable())

    def _resumable(self) -> Results | None:
        return resume_check(
            self.out_dir, self.cfg, self.allow_config_change, self.inputs, self.remedies
        )

    def _run(self, stored: Results | None) -> Results:
        """The run proper, once the folder is locked and ``stored`` proved resumable."""
        cfg = self.cfg
        if stored is not None and stored.completed_tasks == len(cfg.tasks):
            # loading the model and measuring the base again would change nothing on disk
            self.console.print(
                f"{self.out_dir} already holds all {len(cfg.tasks)} tasks of this run: "
                "nothing to train",
                markup=False,
                highlight=False,
            )
            return stored
        writer = RunWriter.open(cfg, self.out_dir, self.console)
        tasks = load_tasks(cfg.tasks, cfg, writer.say)
        probe_cfgs = [p for p in cfg.probes if isinstance(p, TaskConfig)]
        probes = load_tasks(probe_cfgs, cfg, writer.say, probes=True)
        # the method steers its own copy of its config (a budget's knob): cfg stays as planned
        method = self.method or create_method(cfg.method.model_copy(deep=True))
        broken = registry.lora_rule_broken(
            type(method), cfg.finetune.mode, cfg.finetune.lora.regime
        )
        if broken:  # a method instance handed over directly bypassed the config's check
            raise ConfigError(broken)
        model, tokenizer, source = self._load_model()
        if method.uses(Capability.MODEL_SETUP):  # before any saved weights are read into it
            method.setup_model(model)
        # the config as run: train.max_length set (config.yaml keeps it as written)
        fitted = start_up(cfg, model, tokenizer, tasks, probes, self.device, writer.say)
        results = writer.start(cfg, [t.name for t in tasks], stored, self.inputs)
        results.runtime = runtime(fitted, model, self.device)
        distributed.barrier()
        finetuner = Finetuner(model, cfg.finetune)  # checks LoRA targets before training
        scale = ScaleOut.at_start()
        scale.prepare(cfg, method, finetuner, len(tasks), self.console)
        max_length = fitted.train.resolved_max_length
        encoded = encode_remaining(tasks, tokenizer, max_length, results, writer.say)
        evaluator = Evaluator.for_run(fitted, tasks, probes, tokenizer)
        with writer.phase("measuring the base on the probes and the prose"):
            evaluator.measure_base(finetuner.model)  # under FSDP2, the sharded root
        monitor = self._monitor(
            method, finetuner.model, tokenizer, probes, results, writer, max_length
        )
        try:
            with Progress(self.console, enabled=self.progress) as bars:
                loop = TaskLoop(
                    fitted,
                    tasks,
                    method,
                    finetuner,
                    tokenizer,
                    self.device,
                    source,
                    writer,
                    evaluator,
                    scale,
                    bars,
                    monitor,
                    encoded,
                )
                loop.restore(results.completed_tasks)
                if not results.accuracy:
                    self._base_row(loop, results, source)
                    results.write(self.out_dir)
                for index in range(results.completed_tasks + 1, len(tasks) + 1):
                    loop.run_task(index, results)
        finally:
            writer.tracker.finish()
        return results

    def _load_model(self) -> tuple[nn.Module, Any, str]:
        """The model and tokenizer on this process's device, and where they were read from."""
        cfg = self.cfg
        if self.loaded is not None:
            model, tokenizer = self.loaded
            lost = lost_text_warning(tokenizer)  # a user's tokenizer, loaded their way
            if lost:
                self.console.print(
                    f"warning: {lost}", markup=False, highlight=False, soft_wrap=True
                )
            model.to(self.device)
            return model, tokenizer, str(cfg.model.name_or_path or "in-memory model")
        built = None
        if not cfg.model.name_or_path:  # the built-in tiny base: shipped, cached or pretrained
            built = distributed.main_first(
                lambda: ensure_base_model(cfg.model, self.console, self.progress)
            )
        name = str(built or cfg.model.name_or_path or "")
        # A GGUF model is converted on first use: by the main process, the others then read it.
        source = distributed.main_first(lambda: resolve_source(name, self.console.print))
        model, tokenizer = load_model_and_tokenizer(cfg.model, source)
        model.to(self.device)  # type: ignore[arg-type]
        return model, tokenizer, source

    def _monitor(
        self,
        method: Method,
        base: nn.Module,
        tokenizer: Any,
        probes: list[Task],
        results: Results,
        writer: RunWriter,
        max_length: int,
    ) -> BudgetMonitor | None:
        """The forgetting budget's monitor, its probe batch measured now on the base."""
        budget = self.cfg.budget
        if budget is None:
            return None
        with writer.phase("measuring the base on the budget's probe batch"):
            measure = budget_measure(budget, base, tokenizer, probes, max_length)
        return start_monitor(budget, method, measure, probes, results, writer.say)

    def _base_row(self, loop: TaskLoop, results: Results, source: str) -> None:
        """Row 0: from the cache when ``eval.cache_base_row`` holds it, else evaluated (and
        stored there)."""
        path = base_row_path(loop.cfg, source)
        start = time.perf_counter()
        if path is not None and load_base_row(path, results):
            took = round(time.perf_counter() - start, 2)
            results.eval_seconds.append(took)
            results.eval_parts.append({"cache": took})
            loop.writer.say(f"base row read from {path}")
            return
        loop.record_row(results, loop.finetuner.model)
        if path is not None and distributed.is_main_process():
            store_base_row(path, results)
