"""Shared by ``method_steps.py`` and ``task_growth.py``: a registered method's training steps on
the demo's tiny model, after past tasks whose state was built cheaply.

Each past task goes through the method's life cycle as the runner calls it (task start, activation
hooks, training through the step loop or the method's own stage, end of task; no evaluation) for a
few steps (``--state-steps``): a method's state (EWC's Fisher and anchor, replay's memory, SAE-FD's
anchors, attribution's map, O-LoRA's frozen adapters, the merging methods' updates) has its full
size whatever the number of steps that produced it. Two stand-ins keep that cheap, neither of which
changes a step's cost: SAE-FD's SAE is a randomly initialised gated SAE of the trained one's shape
(D = 8·d), and an attribution map left empty (a few steps answer no sample correctly, so no sample
counts) is filled with uniform random relevance, as ``attribution_overhead.py`` does.

Then the next task is timed: a step-loop method by ``peak_memory.timed_steps`` (warm-up, then each
step); a method with its own training stage (``train_stage``) by its whole ``train_task`` over the
plan's steps, its "step" being the median of the steps it runs through the loop other than a
reference model's (Anchored Learning's SFT reference) and ``task_s_per_step`` its whole stage
(reference, caches and merges included) over the plan's steps.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peak_memory import peak_mb, start_window, timed_steps  # benchmarks/ is on sys.path

from forgetless.config.schema import FinetuneConfig, ModelConfig
from forgetless.contract.method import (
    Capability,
    Method,
    RunInfo,
    TaskContext,
    create_method,
    registered_methods,
    trainable_parameters,
)
from forgetless.contract.plan import TrainPlan, TrainStats
from forgetless.core import registry
from forgetless.engine.session import TaskSession
from forgetless.models.finetuner import Finetuner
from forgetless.models.tiny import build_char_tokenizer, build_tiny_model
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import Features, encode_example

TASKS = ("reverse", "cipher", "bracket", "sort", "count", "wordprob", "copy", "upper", "add")
"""Built-in tasks in sequence order: up to 8 past tasks and the timed one."""
EXCLUDED = {"rl": "its RL stage runs TRL's GRPOTrainer (generation), not the step loop"}
INNER_BUDGET = {"anchored"}
"""Methods timed at an inner budget of plan steps / T (Anchored Learning: the matched compute of
``anchored_overhead.py``). The LoRA regime a method needs comes from its class."""


def methods() -> list[str]:
    """Every registered method the harness times (all but ``EXCLUDED``), seq_ft first."""
    names = sorted(set(registered_methods()) - set(EXCLUDED) - {"seq_ft"})
    return ["seq_ft", *names]


def supports(name: str, mode: str) -> bool:
    """Whether ``name`` runs in fine-tuning ``mode`` (full or lora; LoRA in the method's first
    declared regime), by the rules the config's validation reads (``block_expansion`` is
    full-only, O-LoRA LoRA-only)."""
    cls = registered_methods()[name]
    regime = cls.lora_regimes[0] if cls.lora_regimes else "carry"
    return registry.lora_rule_broken(cls, mode, regime) is None


def add_harness_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-steps", type=int, default=3, help="steps per past task")
    parser.add_argument("--past-n-train", type=int, default=128, help="examples per past task")


@dataclass
class Bench:
    """One method's run in this process: the model, the method and the tasks done so far."""

    name: str
    mode: str
    args: argparse.Namespace
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="forgetless-hb-")))
    done: int = 0

    def __post_init__(self) -> None:
        torch.set_flush_denormal(True)
        warnings.simplefilter("ignore")  # the experimental corner warns on import
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = build_char_tokenizer()
        cls = registered_methods()[self.name]
        own: dict[str, Any] = {}
        regime = cls.lora_regimes[0] if cls.lora_regimes else "carry"
        if self.name in INNER_BUDGET:
            outer = cls.config_cls.model_fields["outer_iterations"].default
            own["inner_steps"] = max(1, self.args.steps // outer)
        cfg = cls.config_cls.model_validate(own)
        self.method: Method = create_method(cfg)
        self.regime = regime if self.mode == "lora" else None
        finetune = {"mode": self.mode, "lora": {"regime": regime}}
        self.finetuner = Finetuner(self._base(), FinetuneConfig.model_validate(finetune))
        self.sequence = [
            build_builtin_task(t, n_train=self.args.n_train, n_eval=4, seed=0) for t in TASKS
        ]

    def _base(self) -> torch.nn.Module:
        return build_tiny_model(ModelConfig().tiny, len(self.tokenizer), seed=0).to(self.device)

    def features(self, index: int, n_train: int) -> list[Features]:
        """The first ``n_train`` training examples of task ``index`` (1-based), encoded."""
        task = self.sequence[index - 1]
        return [encode_example(self.tokenizer, e, 64) for e in task.train[:n_train]]

    def _context(self, index: int, n_train: int) -> TaskContext:
        info = RunInfo(
            0, self.work, list(TASKS), [], self.mode, lora_regime=self.regime, load_base=self._base
        )
        return TaskContext(
            info,
            index,
            self.sequence[index - 1],
            self.finetuner.model,
            self.tokenizer,
            self.features(index, n_train),
            self.sequence[: index - 1],
            self.device,
            sequence=self.sequence[:2],
        )

    def _session(self, index: int, n_train: int) -> TaskSession:
        self.finetuner.begin_task(index)
        self.finetuner.model.to(self.device)
        ctx = self._context(index, n_train)
        self._stand_ins(ctx)
        return TaskSession(self.method, ctx, self.tokenizer.pad_token_id, out_dir=self.work)

    def _end(self, session: TaskSession, stats: TrainStats) -> None:
        self.finetuner.end_task()
        session.ctx.model = self.finetuner.model
        session.end({}, stats)
        self.done = session.ctx.task_index

    def _stand_ins(self, ctx: TaskContext) -> None:
        """SAE-FD's random SAE; a random attribution map where the past tasks left none."""
        method: Any = self.method
        if self.name == "sae_fd" and method.sae is None:
            from forgetless.sae.gated import GatedSAE, GatedSAEConfig, freeze

            d = int(ctx.model.config.hidden_size)
            method.sae = freeze(GatedSAE(GatedSAEConfig(d_in=d, d_sae=8 * d), seed=0)).to(
                self.device
            )
        if self.name == "attribution_gate" and self.done and not method.importance:
            gen = torch.Generator().manual_seed(0)
            method.importance = {
                n: torch.rand(p.shape, generator=gen).half()
                for n, p in trainable_parameters(ctx.model).items()
            }

    def _plan(self, steps: int, seed: int) -> TrainPlan:
        return TrainPlan(steps=steps, batch_size=self.args.batch_size, lr=1e-3, seed=seed)

    def past_task(self) -> None:
        """One more past task, ``--state-steps`` steps long."""
        session = self._session(self.done + 1, self.args.past_n_train)
        stats = session.train(self._plan(self.args.state_steps, seed=self.done + 1))
        self._end(session, stats)

    def timed_task(self) -> dict[str, Any]:
        """The next task, timed; it then counts as a past task (its end-of-task work is done)."""
        index = self.done + 1
        session = self._session(index, self.args.n_train)
        counter = TokenCounter(session.ctx.model)
        if self.method.uses(Capability.TRAIN_STAGE):
            hwm = start_window(self.device)
            start = time.perf_counter()
            stats = session.train(self._plan(self.args.steps, seed=1))
            seconds = time.perf_counter() - start
            peak, measure = peak_mb(self.device, hwm)
            inner = [t for c in session.calls if c.label != "reference" for t in c.step_seconds()]
            times = inner or [seconds / max(1, self.args.steps)]
        else:
            with session.started():
                timing = timed_steps(session.loop(), session.ctx.train_features, self.args)
            times, peak, measure = timing["times"], timing["peak_mb"], timing["memory"]
            seconds, stats = sum(times), TrainStats(steps=len(times))
        tokens = counter.close()
        self._end(session, stats)
        return {
            "task_index": index,
            "past_tasks": index - 1,
            "step_s": statistics.median(times),
            "task_s_per_step": seconds / self.args.steps,
            "timed_steps": len(times),
            "peak_mb": peak,
            "memory": measure,
            "state_bytes": state_bytes(self.method.state_dict()),
            "tokens_per_forward": tokens,
        }


class TokenCounter:
    """Padded tokens per training forward of ``model`` (grad-enabled calls only) while open: a
    step's cost follows its batch's padded width, which methods that draw past tasks' samples
    (replay's memory, SAE-FD's anchors) change with those tasks' lengths."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tokens = self.calls = 0
        self.handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if torch.is_grad_enabled() and isinstance(ids, torch.Tensor):
            self.tokens += ids.numel()
            self.calls += 1

    def close(self) -> float:
        """Stop counting; the mean padded tokens per counted forward."""
        self.handle.remove()
        return self.tokens / max(1, self.calls)


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a method's state (nested dicts and lists walked)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


class Control:
    """A stateless ``seq_ft`` model beside the measured one, in the same process: its steps on
    the timed task's data, just before and just after that task, tell what a step of that task
    costs in this process at that moment, whatever the method. The tasks' lengths differ, and a
    process's steps slow down as it ages (the same kernels, called as often, take longer after
    several tasks), so growth is read as the method's step over this control's at each point."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.bench = Bench("seq_ft", "full", args)
        self.args = argparse.Namespace(**{**vars(args), "steps": args.control_steps})
        session = self.bench._session(1, args.past_n_train)
        self.ctx, self.loop = session.ctx, session.loop()

    def step_times(self, index: int) -> tuple[list[float], float]:
        """``--warmup`` then ``--control-steps`` steps on task ``index``'s data: their times and
        the padded tokens per forward."""
        feats = self.bench.features(index, self.args.n_train)
        counter = TokenCounter(self.ctx.model)
        times: list[float] = timed_steps(self.loop, feats, self.args)["times"]
        return times, counter.close()

    def close(self) -> None:
        shutil.rmtree(self.bench.work, ignore_errors=True)


def measure(
    name: str, mode: str, args: argparse.Namespace, points: list[int], control: bool = False
) -> list[dict[str, Any]]:
    """Time the task after each number of past tasks in ``points`` (increasing), in one process;
    with ``control``, each row also has ``control_step_s``: the median step of a ``Control``
    timed around the task.

    A joint-training method (``mtl``) trains only on the first task: it is timed there alone."""
    bench = Bench(name, mode, args)
    beside = Control(args) if control else None
    try:
        if getattr(bench.method, "joint_training", False):
            return [bench.timed_task()]
        rows = []
        for past in points:
            while bench.done < past:
                bench.past_task()
            index = bench.done + 1
            before = beside.step_times(index)[0] if beside else []
            row = bench.timed_task()
            if beside:
                after, tokens = beside.step_times(index)
                row["control_step_s"] = statistics.median(before + after)
                row["control_tokens_per_forward"] = tokens
            rows.append(row)
        return rows
    finally:
        shutil.rmtree(bench.work, ignore_errors=True)
        if beside:
            beside.close()


def median_of(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows)


def alternated(
    cases: list[tuple[str, str]], repeats: int, run: Callable[[str, str], list[dict[str, Any]]]
) -> dict[tuple[str, str], list[list[dict[str, Any]]]]:
    """``run(name, mode)`` for every case, ``repeats`` times, the order reversed every other
    repeat (so that a drift of the machine's load does not favour a case); the rows by case."""
    out: dict[tuple[str, str], list[list[dict[str, Any]]]] = {c: [] for c in cases}
    for repeat in range(repeats):
        for case in cases if repeat % 2 == 0 else cases[::-1]:
            out[case].append(run(*case))
            print(f"  {case[0]} ({case[1]}) repeat {repeat + 1}/{repeats}", flush=True)
    return out
