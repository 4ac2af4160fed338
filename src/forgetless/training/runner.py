"""The continual runner: walks the sequence, evaluates after each task, checkpoints, resumes."""

from __future__ import annotations

import dataclasses
import functools
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from torch import nn

from forgetless.config.evaluation import LmEvalProbe
from forgetless.config.loading import dump_config
from forgetless.config.schema import RunConfig, TaskConfig, probe_names
from forgetless.contract.method import (
    Method,
    RunInfo,
    TaskContext,
    create_method,
)
from forgetless.contract.plan import TrainPlan, TrainStats
from forgetless.core import distributed, registry, sharding
from forgetless.core.rundir import RunDir
from forgetless.core.storage import (
    atomic_dir,
    atomic_write_text,
    load_method_state,
    remove_stale_temps,
    save_method_state,
)
from forgetless.engine.budget import BudgetMonitor, budget_miss_line, budget_unlearned_line
from forgetless.engine.loop import NonFiniteError, steps_for_epochs
from forgetless.engine.progress import Heartbeat, Progress
from forgetless.engine.session import TaskSession
from forgetless.engine.step_checkpoint import StepCheckpointer, plan_fingerprint
from forgetless.engine.tracking import Tracker
from forgetless.errors import ConfigError
from forgetless.eval.generation import EvalResult, completion_logprobs, gold_loglik, kl_drift
from forgetless.eval.lm_eval_probe import run_lm_eval_probe
from forgetless.eval.prose import ProseBase, encode_prose, prose_base, prose_row
from forgetless.eval.scorers import chance_level, score_task
from forgetless.models.finetuner import Finetuner
from forgetless.models.loading import load_model, load_model_and_tokenizer, resolve_source
from forgetless.tasks.base import Task
from forgetless.tasks.formatting import Features, encode_training_set, unknown_token_examples
from forgetless.tasks.general import prose_paragraphs
from forgetless.tasks.loaders import build_task
from forgetless.training.base_row import base_row_path, load_base_row, store_base_row
from forgetless.training.budget_probe import budget_measure, full_probe_loss, left_out
from forgetless.training.inputs import fingerprints
from forgetless.training.outdir import OutDirLock
from forgetless.training.pretrain import ensure_base_model
from forgetless.training.results import Results
from forgetless.training.resume import resume_check


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def task_seed(seed: int, index: int) -> int:
    """Each task trains under its own seed, so a resumed run replays what a full run does."""
    return seed * 1000 + index


def _skip_event(task: str, skipped: list[NonFiniteError]) -> dict[str, Any]:
    """One ``events`` record for the steps of a task dropped under ``on_nonfinite: skip``."""
    terms: dict[str, int] = {}
    for err in skipped:
        terms[err.term] = terms.get(err.term, 0) + 1
    return {
        "type": "nonfinite",
        "action": "skip",
        "task": task,
        "count": len(skipped),
        "steps": [err.step for err in skipped[:100]],
        "terms": terms,
    }


def load_tasks(
    configs: list[TaskConfig], cfg: RunConfig, say: Callable[[str], None] | None = None
) -> list[Task]:
    """Build every task; with ``say``, a long build prints a progress line now and then."""
    heartbeat = Heartbeat(say or (lambda line: None), "building tasks", len(configs))
    tasks = []
    for task in configs:
        tasks.append(build_task(task, cfg.eval, cfg.seed))
        heartbeat.beat()
    return tasks


@dataclass
class Runner:
    """Runs ``cfg`` into ``out_dir``; running again into the same folder resumes it."""

    cfg: RunConfig
    out_dir: Path
    console: Console = field(default_factory=Console)
    progress: bool = True
    allow_config_change: bool = False
    method: Method | None = None
    """A method instance to use instead of building one from ``cfg.method`` (tests, notebooks)."""

    def run(self) -> Results:
        torch.set_flush_denormal(True)
        self.device = distributed.start().device  # accelerate picks the process's device
        if not distributed.is_main_process():  # one process prints and writes
            self.console, self.progress = Console(quiet=True), False
        warning = distributed.launch_warning()
        if warning:
            self.console.print(warning, markup=False, highlight=False)
        self.inputs = fingerprints(self.cfg)
        if not distributed.is_main_process():
            return self._run(self._resumable())
        with OutDirLock(self.out_dir, "run", map(Path, self.inputs)):
            remove_stale_temps(self.out_dir)
            return self._run(self._resumable())

    def _resumable(self) -> Results | None:
        return resume_check(self.out_dir, self.cfg, self.allow_config_change, self.inputs)

    def _run(self, stored: Results | None) -> Results:
        """The run proper, once the folder is locked and ``stored`` proved resumable."""
        cfg = self.cfg
        task_probes = [p for p in cfg.probes if isinstance(p, TaskConfig)]
        tasks = load_tasks(cfg.tasks, cfg, self._say)
        probes = load_tasks(task_probes, cfg, self._say)
        self.lm_probes = [p for p in cfg.probes if isinstance(p, LmEvalProbe)]
        # the method steers its own copy of its config (a budget's knob): cfg stays as planned
        self.active: Method = self.method or create_method(cfg.method.model_copy(deep=True))
        broken = registry.lora_rule_broken(
            type(self.active), cfg.finetune.mode, cfg.finetune.lora.regime
        )
        if broken:  # a method instance handed over directly bypassed the config's check
            raise ConfigError(broken)
        report_to = cfg.report_to if distributed.is_main_process() else "none"
        self.tracker = Tracker(report_to, self.out_dir, cfg.model_dump(mode="json"))
        source = (
            None
            if cfg.model.name_or_path
            else str(
                distributed.main_first(
                    lambda: ensure_base_model(cfg.model, self.console, self.progress)
                )
            )
        )
        self.source = resolve_source(source or cfg.model.name_or_path or "", self.console.print)
        model, self.tokenizer = load_model_and_tokenizer(cfg.model, self.source)
        model.to(self.device)  # type: ignore[arg-type]
        results = self._prepare_out_dir(tasks, stored)
        distributed.barrier()
        self.tasks, self.probes = tasks, probes
        self.finetuner = Finetuner(model, cfg.finetune)  # checks LoRA targets before training
        if distributed.sharded():
            self._attach_adapter()
            self._shard(model)
        if distributed.layout().startswith("zero"):
            self._check_zero()
        self.encoded = self._encode_remaining(results)
        self.base_logprobs = self._probe_logprobs(model) if cfg.eval.kl_drift and probes else None
        self.prose = self._prose_base(model) if cfg.eval.prose else None
        self.monitor = self._budget_monitor(model, results) if cfg.budget else None
        if results.completed_tasks:
            self._restore(results.completed_tasks)
        try:
            with Progress(self.console, enabled=self.progress) as self.bars:
                if not results.accuracy:
                    self._base_row(results)
                    results.write(self.out_dir)
                for index in range(results.completed_tasks + 1, len(tasks) + 1):
                    self._run_task(index, results)
                    self.tracker.log_metrics(results.metrics())
        finally:
            self.tracker.finish()
        return results

    def _say(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _attach_adapter(self) -> None:
        """LoRA adapters attached before the split, each under the seed its task starts with
        (so it starts as a one-process run's does), every random state left as it was."""
        states = random.getstate(), np.random.get_state()
        for index in self.finetuner.tasks_attached_before_split(len(self.tasks)):
            with torch.random.fork_rng():
                seed_everything(task_seed(self.cfg.seed, index))
                self.finetuner.attach_before_split(index)
        random.setstate(states[0])
        np.random.set_state(states[1])

    def _shard(self, model: nn.Module) -> None:
        """Split the model over the processes (an FSDP2 launch), if the run allows it."""
        cfg = self.cfg
        broken = registry.sharding_rule_broken(
            type(self.active), cfg.finetune.mode, cfg.method, cfg.finetune.lora.regime
        )
        if broken:
            raise ConfigError(broken)
        sharding.shard_model(model)
        self.console.print(
            f"FSDP2: the model is sharded over {distributed.world_size()} processes",
            highlight=False,
        )

    def _check_zero(self) -> None:
        """Refuse what cannot train through DeepSpeed's ZeRO-1/2 engine, before any training."""
        cfg = self.cfg
        broken = registry.zero_rule_broken(
            type(self.active), cfg.budget is not None, cfg.train.checkpoint_every
        )
        if broken:
            raise ConfigError(broken)

    def _base_row(self, results: Results) -> None:
        """Row 0: from the cache when ``eval.cache_base_row`` holds it, else evaluated (and
        stored there)."""
        path = base_row_path(self.cfg, self.source)
        start = time.perf_counter()
        if path is not None and load_base_row(path, results):
            results.eval_seconds.append(round(time.perf_counter() - start, 2))
            self.console.print(f"base row read from {path}")
            return
        self._record_row(results, self.finetuner.model)
        if path is not None and distributed.is_main_process():
            store_base_row(path, results)

    def _prepare_out_dir(self, tasks: list[Task], stored: Results | None) -> Results:
        """Write the config, and the results to go on from (``stored``, or a fresh start)."""
        resolved = self.cfg.model_dump(mode="json")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(RunDir(self.out_dir).config, dump_config(self.cfg))
        if stored is not None:
            self._remove_stale(tasks[: stored.completed_tasks])
            stored.config, stored.inputs = resolved, self.inputs
            if stored.completed_tasks:
                self.console.print(f"Resuming after task {stored.completed_tasks} of {len(tasks)}")
            return stored
        return Results(
            config=resolved,
            tasks=[t.name for t in tasks],
            probes=probe_names(self.cfg.probes),
            inputs=self.inputs,
        )

    def _remove_stale(self, finished: list[Task]) -> None:
        """Step checkpoints of tasks that have finished."""
        if not distributed.is_main_process():
            return
        for index, task in enumerate(finished, start=1):
            stale = RunDir(self.out_dir).step_checkpoint(index, task.name)
            if stale.is_dir():
                shutil.rmtree(stale)

    def _encode_remaining(self, results: Results) -> dict[int, list[Features]]:
        """Encode the tasks still to train up front, so a bad example fails before any training.

        Truncation is counted, warned about once per task and recorded in ``events`` (policy in
        docs/reliability.md). Only the next task's features are kept (memory stays one task's);
        later tasks are encoded again when they start.
        """
        max_length, out = self.cfg.train.max_length, {}
        remaining = range(results.completed_tasks + 1, len(self.tasks) + 1)
        heartbeat = Heartbeat(self._say, "encoding tasks", len(remaining))
        for index in remaining:
            heartbeat.beat()
            task = self.tasks[index - 1]
            features, cut = encode_training_set(
                self.tokenizer, task.train, max_length, f"task {task.name!r}"
            )
            if cut:
                self.console.print(
                    f"warning: task {task.name!r}: {cut} of {len(features)} training examples "
                    f"exceed train.max_length={max_length} tokens; their completions are cut "
                    "at the end",
                    markup=False,
                    highlight=False,
                )
                event = {
                    "type": "truncated",
                    "task": task.name,
                    "count": cut,
                    "of": len(features),
                    "max_length": max_length,
                }
                if event not in results.events:
                    results.events.append(event)
            self._warn_unknown(task.name, features, results)
            if index == results.completed_tasks + 1:
                out[index] = features
        return out

    def _warn_unknown(self, task: str, features: list[Features], results: Results) -> None:
        """Examples the tokenizer cannot spell are trained on ``<unk>``: say so, never silently."""
        count = unknown_token_examples(self.tokenizer, features)
        if not count:
            return
        self.console.print(
            f"warning: task {task!r}: {count} of {len(features)} training examples hold text the "
            "tokenizer cannot spell (it becomes the unknown token)",
            markup=False,
            highlight=False,
        )
        event = {"type": "unknown_tokens", "task": task, "count": count, "of": len(features)}
        if event not in results.events:
            results.events.append(event)

    def _restore(self, completed: int) -> None:
        ckpts = RunDir(self.out_dir).task_checkpoints([t.name for t in self.tasks[:completed]])
        missing = [str(c) for c in ckpts if not c.is_dir()]
        if missing:
            raise ConfigError(f"cannot resume: checkpoint missing: {missing[0]}")
        self.finetuner.restore(ckpts)
        state = load_method_state(ckpts[-1])
        if distributed.sharded():
            state = sharding.shard_state_like(state, self.finetuner.model)
        self.active.load_state_dict(state)

    def _probe_logprobs(self, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n, max_len = self.cfg.eval.kl_examples, self.cfg.train.max_length
        return [
            completion_logprobs(model, self.tokenizer, p.eval[:n], max_len) for p in self.probes
        ]

    def _prose_base(self, model: nn.Module) -> tuple[list[torch.Tensor], ProseBase]:
        e = self.cfg.eval
        paragraphs = prose_paragraphs()[: e.prose_paragraphs]
        chunks = encode_prose(self.tokenizer, paragraphs, e.prose_max_tokens)
        with self.console.status("measuring the base on the prose"):
            return chunks, prose_base(model, chunks, e.prose_kl_paragraphs)

    def _evaluate(self, model: nn.Module, cap: int | None) -> dict[str, EvalResult]:
        everything = [*self.tasks, *self.probes]
        out = {}
        with self.bars.task("evaluate", len(everything)) as advance:
            for task in everything:
                shown = task if cap is None else dataclasses.replace(task, eval=task.eval[:cap])
                out[task.name] = score_task(model, self.tokenizer, shown, self.cfg.eval.batch_size)
                advance(None)
        return out

    def _lm_eval_scores(self, model: nn.Module) -> dict[str, float]:
        scores: dict[str, float] = {}
        for probe in self.lm_probes:
            scores.update(
                run_lm_eval_probe(model, self.tokenizer, probe.lm_eval, self.cfg.eval.batch_size)
            )
        return scores

    def _record_row(self, results: Results, model: nn.Module) -> dict[str, EvalResult]:
        """Evaluate ``model`` into a new row, in float32 even under ``train.autocast``: on CPU,
        bf16 autocast made greedy decoding 3x and choice scoring 5x slower (docs/performance.md)."""
        start = time.perf_counter()
        between = 0 < len(results.accuracy) < len(self.tasks)  # neither the base nor the last
        evals = self._evaluate(model, self.cfg.eval.between if between else None)
        results.accuracy.append([evals[t.name].accuracy for t in self.tasks])
        scores = {p.name: evals[p.name].accuracy for p in self.probes}
        scores.update(self._lm_eval_scores(model))
        results.probe_accuracy.append([scores[name] for name in probe_names(self.cfg.probes)])
        results.probe_chance = self._probe_chance()
        self._record_loglik(results, model)
        drift: tuple[float | None, float | None] = (None, None)
        if self.base_logprobs is not None:
            now = self._probe_logprobs(model)
            pairs = [kl_drift(b, n) for b, n in zip(self.base_logprobs, now, strict=True)]
            drift = (float(np.mean([p[0] for p in pairs])), float(np.mean([p[1] for p in pairs])))
        results.kl_base_to_model.append(drift[0])
        results.kl_model_to_base.append(drift[1])
        if self.prose is not None:
            chunks, base = self.prose
            first = not results.prose  # the base itself: measured once already
            shown = chunks[: self.cfg.eval.prose_kl_paragraphs] if between else chunks
            results.prose.append(base.as_row() if first else prose_row(model, shown, base))
        results.eval_seconds.append(round(time.perf_counter() - start, 2))
        return evals

    def _probe_chance(self) -> list[float]:
        chance = {p.name: chance_level(p) for p in self.probes}
        for probe in self.lm_probes:
            chance.update(dict.fromkeys(probe.names, probe.lm_eval.chance))
        return [chance[name] for name in probe_names(self.cfg.probes)]

    def _record_loglik(self, results: Results, model: nn.Module) -> None:
        """The gold completions' mean log-likelihood per task and per probe (lm-eval: None)."""
        n, e = self.cfg.eval.loglik_examples, self.cfg.eval
        if n == 0:
            return

        def of(task: Task) -> float:
            return gold_loglik(
                model, self.tokenizer, task.eval[:n], self.cfg.train.max_length, e.batch_size
            )

        by_probe = {p.name: of(p) for p in self.probes}
        results.loglik.append([of(t) for t in self.tasks])
        results.probe_loglik.append([by_probe.get(name) for name in probe_names(self.cfg.probes)])

    def _plan(self, index: int, task_cfg: TaskConfig, n_examples: int) -> TrainPlan:
        t, o = self.cfg.train, task_cfg.train
        batch_size = o.batch_size or t.batch_size
        epochs = o.epochs or (None if o.steps else t.epochs)
        steps = o.steps or t.steps or 1
        if epochs is not None:
            steps = steps_for_epochs(n_examples, batch_size, t.grad_accum, epochs)
        return TrainPlan(
            steps=steps,
            batch_size=batch_size,
            lr=o.lr or t.lr,
            seed=task_seed(self.cfg.seed, index),
            grad_accum=t.grad_accum,
            weight_decay=t.weight_decay,
            warmup_steps=t.warmup_steps,
            scheduler=t.scheduler,
            max_grad_norm=t.max_grad_norm,
            on_nonfinite=t.on_nonfinite,
            autocast=t.autocast == "bf16",
            optimizer_restarts=t.optimizer_restarts,
        )

    def _context(self, index: int, features: list[Features]) -> TaskContext:
        lora = self.cfg.finetune.lora.regime if self.cfg.finetune.mode == "lora" else None
        info = RunInfo(
            seed=self.cfg.seed,
            out_dir=self.out_dir,
            task_names=[t.name for t in self.tasks],
            probe_names=probe_names(self.cfg.probes),
            finetune_mode=self.cfg.finetune.mode,
            max_length=self.cfg.train.max_length,
            lora_regime=lora,
            load_base=functools.partial(load_model, self.source, self.cfg.model),
        )
        return TaskContext(
            info,
            index,
            self.tasks[index - 1],
            self.finetuner.model,
            self.tokenizer,
            features,
            self.tasks[: index - 1],
            self.device,
            sequence=list(self.tasks),
        )

    def _run_task(self, index: int, results: Results) -> None:
        task, method = self.tasks[index - 1], self.active
        seed_everything(task_seed(self.cfg.seed, index))
        self.finetuner.begin_task(index)
        self.finetuner.model.to(self.device)
        features = self.encoded.pop(index, None)
        if features is None:
            where = f"task {task.name!r}"
            features, _ = encode_training_set(
                self.tokenizer, task.train, self.cfg.train.max_length, where
            )
        ctx = self._context(index, features)
        plan = self._plan(index, self.cfg.tasks[index - 1], len(features))
        if self.monitor is not None:
            self.monitor.begin_task(plan.steps)
        skipped: list[NonFiniteError] = []
        session = self._session(ctx, skipped.append)
        try:
            stats = session.train(plan)
        except NonFiniteError as err:
            results.events.append(err.event("stop"))  # recorded before the error propagates
            results.write(self.out_dir)
            raise
        if skipped:
            results.events.append(_skip_event(task.name, skipped))
        final = RunDir(self.out_dir).task_checkpoint(index, task.name)
        final.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(final) as tmp:
            self.finetuner.save(tmp)
            self.finetuner.end_task()
            ctx.model = self.finetuner.model
            evals = self._record_row(results, session.evaluated_model())
            session.end(evals, stats)
            save_method_state(tmp, self._reduced_state(method))
        layout = {"processes": distributed.world_size(), "parallel": distributed.layout()}
        budget = self._budget_row(task.name, results)
        results.per_task.append({"task": task.name, **stats.as_dict(), **layout, **budget})
        results.write(self.out_dir)
        step_dir = RunDir(self.out_dir).step_checkpoint(index, task.name)
        if distributed.is_main_process() and step_dir.is_dir():
            shutil.rmtree(step_dir)  # the task checkpoint supersedes it
        self._report_task(index, stats, results)

    def _reduced_state(self, method: Method) -> dict[str, Any]:
        """The method's state reduced over processes by its ``reduce_ops``; every process then
        holds what is saved, so a resumed run and an uninterrupted one go on alike."""
        state = method.state_dict()
        if distributed.sharded():  # each process computed its shards from the same data
            return dict(sharding.gather_state(state))
        if distributed.world_size() == 1 or not method.reduce_ops:
            return state
        reduced: dict[str, Any] = distributed.reduce_state(state, method.reduce_ops)
        method.load_state_dict(reduced)
        return reduced

    def _session(self, ctx: TaskContext, on_skip: Callable[[NonFiniteError], None]) -> TaskSession:
        folder = RunDir(self.out_dir).step_checkpoint(ctx.task_index, ctx.task.name)

        def checkpointer(call: str, plan: TrainPlan) -> StepCheckpointer | None:
            return self._checkpointer(folder / call if call else folder, self.active, plan)

        return TaskSession(
            self.active,
            ctx,
            self.tokenizer.pad_token_id,
            self.bars,
            self.tracker.log_step,
            on_skip,
            checkpointer,
            self.out_dir,
            monitor=self.monitor,
        )

    def _budget_monitor(self, base: nn.Module, results: Results) -> BudgetMonitor:
        """The forgetting budget's monitor, its probe batch measured now on the base."""
        cfg = self.cfg
        assert cfg.budget is not None
        with self.console.status("measuring the base on the budget's probe batch"):
            measure = budget_measure(
                cfg.budget, base, self.tokenizer, self.probes, cfg.train.max_length
            )
        if skipped := left_out(self.probes):
            self.console.print(
                f"budget: the probe batch leaves out {', '.join(skipped)} (no held-out examples; "
                "the full evaluation at each task's end covers every probe)",
                markup=False,
                highlight=False,
            )
        monitor = BudgetMonitor(cfg.budget, self.active, measure)
        done = [t["budget"]["end_value"] for t in results.per_task if "budget" in t]
        if done:  # a resumed run goes on with the knob where its last task left it
            monitor.value = done[-1]
            self.active.set_knob(done[-1])
        return monitor

    def _budget_row(self, task: str, results: Results) -> dict[str, Any]:
        """The task's budget trace, and whether the full evaluation probes kept the budget; a
        budget not kept is said in one line and recorded as an event, with the best found."""
        budget = self.cfg.budget
        if self.monitor is None or budget is None:
            return {}
        summary = self.monitor.summary()
        loss = full_probe_loss(budget, results)
        kept = loss is None or loss <= budget.max_loss
        summary.update(metric=budget.metric, max_loss=budget.max_loss, loss_full=loss, kept=kept)
        line, action = "", ""
        if not kept:
            line = budget_miss_line(task, budget.metric, budget.max_loss, loss, self.monitor)
            action = "not_kept"
        elif self.monitor.nothing_kept():
            line = budget_unlearned_line(task, budget.metric, budget.max_loss, self.monitor)
            action = "not_learned"
        if line:
            self.console.print(f"warning: {line}", markup=False, highlight=False)
            results.events.append({"type": "budget", "action": action, "task": task})
            summary["warning"] = line
        return {"budget": summary}

    def _checkpointer(
        self, folder: Path, method: Method, plan: TrainPlan
    ) -> StepCheckpointer | None:
        every = self.cfg.train.checkpoint_every
        return (
            None
            if every is None
            else StepCheckpointer(folder, every, method, plan_fingerprint(plan))
        )

    def _report_task(self, index: int, stats: TrainStats, results: Results) -> None:
        row = results.accuracy[-1]
        accs = ", ".join(f"{escape(t)} {a:.2f}" for t, a in zip(results.tasks, row, strict=True))
        probes = ", ".join(
            f"{escape(p)} {a:.2f}"
            for p, a in zip(results.probes, results.probe_accuracy[-1], strict=True)
        )
        self.console.print(
            f"[bold]task {index}/{len(self.tasks)} {escape(self.tasks[index - 1].name)}[/]: "
            f"{stats.steps} steps in "
            f"{stats.seconds:.1f}s ({stats.steps_per_second:.1f}/s) | tasks: {accs}"
            + (f" | probes: {probes}" if probes else "")
        )
