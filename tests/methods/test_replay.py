"""Experience replay: reservoir memory, batch mixing at the set ratio, state and determinism."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_run_config, write_jsonl
from datasets import Dataset
from rich.console import Console
from torch import nn

from forgetless.bench.sweep import plan_runs
from forgetless.bench.variants import select_variants
from forgetless.config.loading import validate_config
from forgetless.contract.method import RunInfo, StepContext, TaskContext, TaskEndContext
from forgetless.contract.plan import TrainStats
from forgetless.core.storage import load_method_state, save_method_state
from forgetless.engine.loop import causal_lm_loss
from forgetless.errors import ConfigError
from forgetless.methods.replay import (
    PROSE_HELD_OUT,
    Replay,
    ReplayConfig,
    encode_plain_text,
    general_features,
    mix_batch,
    mix_sources,
    replay_count,
    reservoir_update,
)
from forgetless.models.tiny import build_char_tokenizer
from forgetless.tasks.base import Example, Task
from forgetless.tasks.builtin import build_builtin_task
from forgetless.tasks.formatting import Features, collate, encode_example
from forgetless.tasks.general import prose_paragraphs
from forgetless.training.export import checkpoint_model, load_run
from forgetless.training.runner import Runner

REPLAY = {"name": "replay", "buffer_size": 16, "ratio": 0.5}
PINNED_PAST_DRAWS = [118, 100, 119, 116]
"""What replay drew before general data existed (buffer 8, ratio 0.5, task 2, step 3)."""


def feat(i: int) -> Features:
    return {"input_ids": [i, i + 1], "labels": [-100, i + 1]}


def key(f: Features) -> tuple[int, ...]:
    return tuple(f["input_ids"])


def test_reservoir_never_exceeds_capacity_and_keeps_the_first_items() -> None:
    rng = random.Random(0)
    buffer, seen = reservoir_update([], 0, [feat(i) for i in range(3)], 5, rng)
    assert [key(f) for f in buffer] == [(0, 1), (1, 2), (2, 3)] and seen == 3
    for chunk in range(10):
        before = list(buffer)
        buffer, seen = reservoir_update(buffer, seen, [feat(i) for i in range(7)], 5, rng)
        assert len(buffer) == 5 and seen == 3 + 7 * (chunk + 1)
        assert len(before) <= 5, "the input buffer is not modified"
    assert reservoir_update([], 0, [feat(1)], 0, rng) == ([], 1)


def test_reservoir_is_uniform_over_the_whole_stream() -> None:
    """Fed in two chunks (two tasks), every one of the 40 items is kept with p = 10/40."""
    rng = random.Random(1)
    trials, counts = 3000, [0] * 40
    for _ in range(trials):
        buffer, seen = reservoir_update([], 0, [feat(i) for i in range(20)], 10, rng)
        buffer, seen = reservoir_update(buffer, seen, [feat(i) for i in range(20, 40)], 10, rng)
        for f in buffer:
            counts[f["input_ids"][0]] += 1
    freqs = [c / trials for c in counts]
    assert all(abs(p - 0.25) < 0.05 for p in freqs), freqs
    assert abs(sum(freqs[:20]) - sum(freqs[20:])) < 0.3, "the first task is not favoured"


def test_mix_batch_replaces_the_set_fraction() -> None:
    batch, memory = [feat(i) for i in range(8)], [feat(100 + i) for i in range(16)]
    for ratio, k in [(0.0, 0), (0.25, 2), (0.5, 4), (1.0, 8)]:
        mixed = mix_batch(batch, memory, ratio, random.Random(0))
        assert len(mixed) == 8
        assert sum(f["input_ids"][0] >= 100 for f in mixed) == k
        assert len({key(f) for f in mixed}) == 8, "drawn without replacement"
    assert mix_batch(batch, [], 0.5, random.Random(0)) == batch, "empty memory: batch unchanged"
    small = mix_batch(batch, memory[:2], 1.0, random.Random(0))
    assert len(small) == 8 and all(f["input_ids"][0] >= 100 for f in small)


def test_a_share_below_one_row_a_batch_still_replays_on_average() -> None:
    """6.25% of 8 rows is half a row: rounded to the nearest it replayed nothing, ever."""
    batch, memory = [feat(i) for i in range(8)], [feat(100 + i) for i in range(16)]
    for ratio, low, high in [(0.0625, 0, 1), (0.95, 7, 8), (0.3, 2, 3)]:
        counts = [
            sum(f["input_ids"][0] >= 100 for f in mix_batch(batch, memory, ratio, random.Random(s)))
            for s in range(4000)
        ]
        assert set(counts) == {low, high}, "the share rounds down or up, never further"
        assert sum(counts) / len(counts) == pytest.approx(ratio * 8, abs=0.03)


def test_a_whole_share_takes_no_random_draw() -> None:
    """Whole counts replay as before: the draws that follow are the same."""
    rng, untouched = random.Random(7), random.Random(7)
    assert replay_count(8, 0.25, 16, rng) == 2 and replay_count(10, 0.3, 16, rng) == 3
    assert rng.random() == untouched.random()


def contexts(index: int, features: list[Features]) -> TaskContext:
    run = RunInfo(seed=0, out_dir=Path("."), task_names=[], probe_names=[], finetune_mode="full")
    task = Task(f"t{index}", [], [Example("p", "c")])
    return TaskContext(run, index, task, nn.Linear(1, 1), None, features, [], torch.device("cpu"))


def end(method: Replay, index: int, features: list[Features]) -> TaskContext:
    ctx = contexts(index, features)
    method.on_task_end(TaskEndContext(ctx, {}, TrainStats()))
    return ctx


def test_hook_replays_past_tasks_and_is_deterministic() -> None:
    def fresh() -> Replay:
        method = Replay(ReplayConfig(name="replay", buffer_size=8, ratio=0.25, seed=3))
        end(method, 1, [feat(100 + i) for i in range(20)])
        return method

    method, ctx = fresh(), contexts(2, [])
    assert len(method.buffer) == 8 and method.seen == 20
    batch = [feat(i) for i in range(8)]
    out = method.transform_batch(batch, StepContext(ctx, step=0, total_steps=4))
    assert sum(f["input_ids"][0] >= 100 for f in out) == 2
    assert out[:6] == batch[:6]
    steps = [method.transform_batch(batch, StepContext(ctx, s, 4)) for s in range(1, 4)]
    again = fresh()
    assert again.buffer == method.buffer
    assert again.transform_batch(batch, StepContext(ctx, 0, 4)) == out
    assert [again.transform_batch(batch, StepContext(ctx, s, 4)) for s in range(1, 4)] == steps
    draws = {tuple(key(f) for f in b[6:]) for b in [out, *steps]}
    assert len(draws) > 1, "each step draws anew"


def test_state_dict_round_trip_restores_the_buffer(tmp_path: Path) -> None:
    method = Replay(ReplayConfig.model_validate({"buffer_size": 4}))
    end(method, 1, [feat(i) for i in range(10)])
    save_method_state(tmp_path, method.state_dict())
    restored = Replay(ReplayConfig.model_validate({"buffer_size": 4}))
    restored.load_state_dict(load_method_state(tmp_path))
    assert restored.buffer == method.buffer and restored.seen == 10
    end(method, 2, [feat(50 + i) for i in range(10)])
    end(restored, 2, [feat(50 + i) for i in range(10)])
    assert restored.buffer == method.buffer and restored.seen == method.seen == 20


class RecordingReplay(Replay):
    """Records every mixed batch by task; optionally crashes when task 2 starts training."""

    def __init__(self, config: Any, crash: bool = False) -> None:
        super().__init__(config)
        self.crash = crash
        self.batches: dict[int, list[list[Features]]] = {}
        self.task_features: dict[int, list[Features]] = {}

    def transform_batch(self, features: list[Features], ctx: StepContext) -> list[Features]:
        if self.crash and ctx.task.task_index == 2:
            raise KeyboardInterrupt
        self.task_features[ctx.task.task_index] = ctx.task.train_features
        out = super().transform_batch(features, ctx)
        self.batches.setdefault(ctx.task.task_index, []).append(out)
        return out


def run(model_dir: Path, out: Path, method: Replay, **overrides: Any) -> dict[str, Any]:
    cfg = validate_config(tiny_run_config(model_dir, method=REPLAY, **overrides))
    return Runner(cfg, out, Console(quiet=True), progress=False, method=method).run().to_json()


def test_runner_mixes_past_task_examples_at_the_ratio(tiny_model_dir: Path, tmp_path: Path) -> None:
    method = RecordingReplay(ReplayConfig.model_validate(REPLAY))
    results = run(tiny_model_dir, tmp_path, method)
    first = {key(f) for f in method.task_features[1]}
    second = {key(f) for f in method.task_features[2]}
    assert first and second and not first & second
    assert all(key(f) in first for b in method.batches[1] for f in b), "nothing to replay yet"
    assert len(method.batches[2]) == results["per_task"][1]["steps"] == 4
    state = load_method_state(tmp_path / "checkpoints" / "task-01-reverse")
    assert len(state["buffer"]) == 16 and state["seen"] == 32
    memory = {key(f) for f in state["buffer"]}
    for batch in method.batches[2]:
        assert len(batch) == 8
        replayed = [f for f in batch if key(f) in first]
        assert len(replayed) == 4 and all(key(f) in second for f in batch if f not in replayed)
        assert all(key(f) in memory for f in replayed), "replayed from the task-1 memory"
    assert len(method.buffer) == 16 and method.seen == 64


def test_resumed_run_replays_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    full = RecordingReplay(ReplayConfig.model_validate(REPLAY))
    expected = run(tiny_model_dir, tmp_path / "full", full)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_model_dir, tmp_path / "crash", RecordingReplay(full.config, crash=True))
    resumed = RecordingReplay(full.config)
    results = run(tiny_model_dir, tmp_path / "crash", resumed)
    assert resumed.batches[2] == full.batches[2]
    assert resumed.buffer == full.buffer and resumed.seen == full.seen
    assert results["accuracy_matrix"] == expected["accuracy_matrix"]


# --- general data --------------------------------------------------------------------------------


def general_ctx(index: int, max_length: int = 24) -> TaskContext:
    """A task context with the char tokenizer (general data is encoded on the first batch)."""
    run = RunInfo(0, Path("."), [], [], "full", max_length=max_length)
    task = Task(f"t{index}", [], [Example("p", "c")])
    return TaskContext(
        run, index, task, nn.Linear(1, 1), build_char_tokenizer(), [], [], torch.device("cpu")
    )


def general_records(n: int = 12) -> list[dict[str, str]]:
    return [{"prompt": f"g{i}:", "completion": f"z{i}"} for i in range(n)]


def encoded(records: list[dict[str, str]], max_length: int = 24) -> set[tuple[int, ...]]:
    tokenizer = build_char_tokenizer()
    examples = [Example(r["prompt"], r["completion"]) for r in records]
    return {key(encode_example(tokenizer, e, max_length)) for e in examples}


def test_mix_sources_gives_each_pool_its_ratio() -> None:
    batch = [feat(i) for i in range(8)]
    past, general = [feat(100 + i) for i in range(16)], [feat(200 + i) for i in range(16)]
    for r_past, r_general, (k_past, k_general) in [
        (0.25, 0.25, (2, 2)),
        (0.25, 0.5, (2, 4)),
        (0.0, 0.75, (0, 6)),
        (0.5, 0.5, (4, 4)),
    ]:
        mixed = mix_sources(batch, [(past, r_past), (general, r_general)], random.Random(0))
        assert (
            len(mixed) == 8 and mixed[: 8 - k_past - k_general] == batch[: 8 - k_past - k_general]
        )
        assert sum(100 <= f["input_ids"][0] < 200 for f in mixed) == k_past
        assert sum(f["input_ids"][0] >= 200 for f in mixed) == k_general
    empty_past = mix_sources(batch, [([], 0.5), (general, 0.25)], random.Random(0))
    assert sum(f["input_ids"][0] >= 200 for f in empty_past) == 2 and empty_past[:6] == batch[:6]
    odd = mix_sources(batch[:3], [(past, 0.5), (general, 0.5)], random.Random(0))
    assert len(odd) == 3, "rounding up twice never pushes the batch past its size"


def test_general_jsonl_examples_enter_every_batch_at_their_ratio(tmp_path: Path) -> None:
    records = general_records()
    source = write_jsonl(tmp_path / "general.jsonl", records)
    config = ReplayConfig.model_validate(
        {"ratio": 0.25, "general": {"source": str(source), "ratio": 0.5}}
    )
    method, expected = Replay(config), encoded(records)
    batch = [feat(i) for i in range(8)]
    first = method.transform_batch(batch, StepContext(general_ctx(1), 0, 4))
    assert first[:4] == batch[:4], "task 1: no memory yet, half the batch is general data"
    assert all(key(f) in expected for f in first[4:])
    end(method, 1, [feat(100 + i) for i in range(20)])
    later = method.transform_batch(batch, StepContext(general_ctx(2), 0, 4))
    assert later[:2] == batch[:2]
    assert all(f["input_ids"][0] >= 100 for f in later[2:4]), "then a quarter from the memory"
    assert all(key(f) in expected for f in later[4:])


def test_general_data_from_dataset_folders_and_the_prose(tmp_path: Path) -> None:
    records = general_records()
    saved, files = tmp_path / "saved", tmp_path / "files"
    Dataset.from_list(records).save_to_disk(str(saved))
    files.mkdir()
    Dataset.from_list(records).to_parquet(str(files / "part-0.parquet"))
    tokenizer = build_char_tokenizer()
    for folder in (saved, files):
        got = general_features(str(folder), tokenizer, 24, limit=5)
        assert len(got) == 5 and {key(f) for f in got} <= encoded(records)
    prose = general_features("prose", tokenizer, 24, limit=100)
    paragraphs = prose_paragraphs()
    assert len(prose) == len(paragraphs) - PROSE_HELD_OUT > 0
    first_kept = tokenizer(paragraphs[PROSE_HELD_OUT], add_special_tokens=False)["input_ids"]
    assert prose[0] == {"input_ids": first_kept[:24], "labels": first_kept[:24]}
    held_out = {key(f) for f in encode_plain_text(tokenizer, paragraphs[:PROSE_HELD_OUT], 24)}
    assert not held_out & {key(f) for f in prose}, "the KL paragraphs are never replayed"


def test_past_tasks_off_replays_general_data_only_and_past_only_is_unchanged(
    tmp_path: Path,
) -> None:
    source = write_jsonl(tmp_path / "general.jsonl", general_records())
    only = Replay(
        ReplayConfig.model_validate(
            {"past_tasks": False, "general": {"source": str(source), "ratio": 0.5}}
        )
    )
    end(only, 1, [feat(100 + i) for i in range(20)])
    assert only.buffer == [] and only.seen == 0, "no memory is kept"
    batch = [feat(i) for i in range(8)]
    out = only.transform_batch(batch, StepContext(general_ctx(2), 0, 4))
    assert out[:4] == batch[:4] and all(key(f) in encoded(general_records()) for f in out[4:])
    past = Replay(ReplayConfig.model_validate({"buffer_size": 8, "ratio": 0.5, "past_tasks": True}))
    end(past, 1, [feat(100 + i) for i in range(20)])
    drawn = past.transform_batch(batch, StepContext(general_ctx(2), 3, 4))
    assert [f["input_ids"][0] for f in drawn] == [0, 1, 2, 3, *PINNED_PAST_DRAWS]
    assert past.general is None


def test_general_source_is_checked_when_the_config_is(tiny_model_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.jsonl"
    method = {"name": "replay", "general": {"source": str(missing)}}
    with pytest.raises(ConfigError) as caught:
        validate_config(tiny_run_config(tiny_model_dir, method=method))
    message = str(caught.value)
    assert "method.general.source" in message and str(missing) in message
    assert "\n" not in message
    (tmp_path / "empty").mkdir()
    method["general"] = {"source": str(tmp_path / "empty")}
    with pytest.raises(ConfigError, match=r"method\.general\.source: .*holds no dataset"):
        validate_config(tiny_run_config(tiny_model_dir, method=method))
    with pytest.raises(ConfigError, match="past_tasks: false needs general"):
        validate_config(
            tiny_run_config(tiny_model_dir, method={"name": "replay", "past_tasks": False})
        )
    both = {"name": "replay", "ratio": 0.5, "general": {"source": "prose", "ratio": 0.75}}
    with pytest.raises(ConfigError, match="exceed the whole batch"):
        validate_config(tiny_run_config(tiny_model_dir, method=both))


def test_replay_general_is_a_bench_baseline(tiny_model_dir: Path, tmp_path: Path) -> None:
    (variant,) = select_variants(["replay-general"], [])
    (planned,) = plan_runs(tiny_run_config(tiny_model_dir), [variant], 1, 1, tmp_path)
    cfg = planned[2]
    assert cfg.method.general is not None and cfg.method.general.source == "prose"
    method = RecordingReplay(cfg.method)
    Runner(cfg, tmp_path / "run", Console(quiet=True), progress=False, method=method).run()
    prose = {key(f) for f in general_features("prose", build_char_tokenizer(), 32, limit=1000)}
    for batches in method.batches.values():
        for batch in batches:
            assert sum(key(f) in prose for f in batch) == 2, "a quarter of every batch of 8"


def _first_task_loss(out: Path) -> float:
    """The run's final model's cross-entropy on the first task's held-out examples."""
    cfg, _ = load_run(out)
    model, tokenizer = checkpoint_model(cfg, out, [t.display_name for t in cfg.tasks], 2)
    task = build_builtin_task(cfg.tasks[0].display_name, 8, 32, cfg.seed)
    batch = collate([encode_example(tokenizer, ex, 32) for ex in task.eval], 0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return float(causal_lm_loss(logits, batch["labels"]))


def test_replay_keeps_the_first_task_better_than_seq_ft(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """What replay is for, on a model: after the second task, the first task's held-out loss is
    lower with half of each batch replayed than under plain sequential training at the same
    seed, steps and rate."""
    train = {"steps": 24, "batch_size": 8, "lr": 3e-3, "max_length": 32}
    losses = {}
    for name, method in (("replay", REPLAY), ("seq_ft", {"name": "seq_ft"})):
        raw = tiny_run_config(tiny_model_dir, method=method, train=train)
        Runner(validate_config(raw), tmp_path / name, Console(quiet=True), progress=False).run()
        losses[name] = _first_task_loss(tmp_path / name)
    assert losses["replay"] < losses["seq_ft"] - 0.1, losses
