"""Two processes through ``accelerate launch`` against one: with 2 × batch b/2 against 1 × batch b
the per-step losses agree to float tolerance, the method state agrees, and only the main process
writes. The fast tier runs seq_ft; the slow tier every method with cross-step state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cli_runs import (
    cli,
    final_state,
    killed_at,
    results,
    step_losses,
    two_processes,
    write_config,
)
from conftest import tiny_run_config
from gguf_fixture import write_tiny_gguf
from safetensors.torch import load_file

from forgetless.testing import smoke_method
from forgetless.training.pretrain import SHIPPED_BASE

SLOW = pytest.mark.slow
CASES = [  # the fast tier keeps one two-process run: the sharded seq_ft one below
    pytest.param("seq_ft", "full", marks=SLOW),
    pytest.param("ewc", "full", marks=SLOW),
    pytest.param("replay", "full", marks=SLOW),
    pytest.param("attribution_gate", "full", marks=SLOW),
    pytest.param("anchored", "full", marks=SLOW),
    pytest.param("sae_fd", "lora", marks=SLOW),
    pytest.param("freeze", "full", marks=SLOW),
    pytest.param("task_arithmetic", "full", marks=SLOW),
    pytest.param("ties", "full", marks=SLOW),
    pytest.param("opcm", "full", marks=SLOW),
    pytest.param("o_lora", "lora", marks=SLOW),
]


def _config(model_dir: Path, method: str, mode: str) -> dict[str, Any]:
    case, finetune = smoke_method(method)
    lora = {"r": 2, **finetune.get("lora", {})}
    raw = tiny_run_config(
        model_dir,
        method=case,
        finetune={"mode": mode, "lora": lora},
        train={"steps": 4, "batch_size": 8, "lr": 1e-3, "max_length": 32},
    )
    if method == "attribution_gate":  # a base that answers the first task: the maps gate task 2
        raw.update(model={"name_or_path": str(SHIPPED_BASE)}, tasks=["copy", "reverse"])
        raw["probes"] = ["upper"]
    return raw


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def _same_files_and_state(one: Path, two: Path, atol: float = 1e-4, step: float = 0.0) -> None:
    """The same files, and the final weights and method state to ``atol`` (tied weights saved
    once, under the same name); with ``step``, up to one element in 1000 of a tensor may differ
    by at most ``step``.

    That allowance is for the trained shipped base: a weight whose gradient is near zero in
    the second task (the base answers the first) gets an AdamW step of its own size from the
    float-order noise of the gradient's reduction. seq_ft on that base and those tasks differs
    the same way (one element of layer 0's o_proj, by 1.35e-4, where each step is 1e-3)."""
    assert _files(two) == _files(one)
    state_one, state_two = final_state(one), final_state(two)
    assert state_one.keys() == state_two.keys()
    for name, tensors in state_one.items():
        assert tensors.keys() == state_two[name].keys(), name
        for key, value in tensors.items():
            got = state_two[name][key]
            off = ~torch.isclose(got, value, rtol=1e-3, atol=atol)
            if step and 0 < int(off.sum()) <= value.numel() // 1000:
                assert float((got - value)[off].abs().max()) <= step, key
                continue
            torch.testing.assert_close(got, value, rtol=1e-3, atol=atol)


@pytest.mark.parametrize(("method", "mode"), CASES)
def test_two_processes_match_one(
    tiny_model_dir: Path, tmp_path: Path, method: str, mode: str
) -> None:
    config = write_config(tmp_path, _config(tiny_model_dir, method, mode))
    cli(config, tmp_path / "one")
    two_processes(config, tmp_path / "two")
    assert {t["parallel"] for t in results(tmp_path / "two")["per_task"]} == {"ddp"}
    if method == "attribution_gate":  # the maps are not empty: the gate acts in task 2
        assert results(tmp_path / "two")["per_task"][0]["details"]["attribution"]["samples_correct"]

    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert all(one) and [len(t) for t in one] == [len(t) for t in two]
    for a, b in zip(one, two, strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    _same_files_and_state(tmp_path / "one", tmp_path / "two", step=_adam_step(method))


@pytest.mark.parametrize(
    "method",
    [
        "seq_ft",
        *(
            pytest.param(m, marks=SLOW)
            for m in (
                "low_lr",
                "ewc",
                "replay",
                "kl_sft",
                "freeze",
                "attribution_gate",
                "task_arithmetic",
                "ties",
                "opcm",
                "mtl",
                "sae_fd",
                "anchored",
            )
        ),
    ],
)
def test_two_sharded_processes_match_one(tiny_model_dir: Path, tmp_path: Path, method: str) -> None:
    """FSDP2 (``fully_shard``, gloo): each process holds half of every weight, FSDP
    reduce-scatters the gradients, the task checkpoint is gathered into one file."""
    raw = _config(tiny_model_dir, method, "full")
    if method == "ewc":  # a penalty as large as the loss: its gradient skips FSDP's averaging
        raw["method"]["lam"] = 1e9
    config = write_config(tmp_path, raw)
    cli(config, tmp_path / "one")
    two_processes(config, tmp_path / "two", fsdp=True)
    layouts = {(t["processes"], t["parallel"]) for t in results(tmp_path / "two")["per_task"]}
    assert layouts == {(2, "fsdp2")}
    if method == "attribution_gate":
        scored = results(tmp_path / "two")["per_task"][0]["details"]["attribution"]
        assert scored["samples_correct"] > 0 and scored["task_map"]["mean"] > 0

    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    trained = one[:1] if method == "mtl" else one  # mtl trains every task at once, in task 1
    assert all(trained) and [len(t) for t in one] == [len(t) for t in two]
    for a, b in zip(one, two, strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    _same_files_and_state(tmp_path / "one", tmp_path / "two", step=_adam_step(method))


def _adam_step(method: str) -> float:
    """The learning rate, an AdamW step's size, for runs on the trained shipped base."""
    return 1e-3 if method == "attribution_gate" else 0.0


ZERO_CASES = [
    (stage, method, mode)
    for stage in (1, 2)
    for method, mode in (
        ("seq_ft", "full"),
        ("ewc", "full"),
        ("attribution_gate", "full"),
        ("anchored", "full"),
        ("sae_fd", "lora"),
        ("ties", "full"),
    )
]


@SLOW
@pytest.mark.parametrize(("stage", "method", "mode"), ZERO_CASES)
def test_two_zero_processes_match_one(
    tiny_model_dir: Path, tmp_path: Path, stage: int, method: str, mode: str
) -> None:
    """DeepSpeed ZeRO-1/2 through accelerate: the engine reduces the gradients and steps the
    optimizer; an update gate's writes reach the engine's float32 partitions (attribution_gate),
    each of anchored's loops gets its own engine, and a merge between tasks (ties) is kept."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is installed apart: make deepspeed")
    config = write_config(tmp_path, _config(tiny_model_dir, method, mode))
    cli(config, tmp_path / "one")
    two_processes(config, tmp_path / "two", zero=stage)
    layouts = {(t["processes"], t["parallel"]) for t in results(tmp_path / "two")["per_task"]}
    assert layouts == {(2, f"zero{stage}")}
    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert all(one) and [len(t) for t in one] == [len(t) for t in two]
    for a, b in zip(one, two, strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    # the engine's AdamW steps one flat float32 partition: under the gate, one weight of 16384
    # ends 1.3e-4 from the one-process run's (its losses agree to 3e-6 relative)
    atol = 2e-4 if method == "attribution_gate" else 1e-4
    _same_files_and_state(tmp_path / "one", tmp_path / "two", atol)


@SLOW
@pytest.mark.parametrize("method", ["ewc", "ties"])
def test_a_run_killed_on_one_process_resumes_sharded(
    tiny_model_dir: Path, tmp_path: Path, method: str
) -> None:
    """The task-1 checkpoint (weights and the method state, whole: EWC's Fisher and anchor,
    TIES's stored update) is read by two sharded processes on resume (EWC's state split like
    its weights, TIES's kept whole), and task 2 goes on as in an uninterrupted run."""
    raw = _config(tiny_model_dir, method, "full")
    if method == "ewc":
        raw["method"]["lam"] = 1e9
    config = write_config(tmp_path, raw)
    cli(config, tmp_path / "one")
    killed_at("between_tasks", 1, config, tmp_path / "two")
    assert len(results(tmp_path / "two")["per_task"]) == 1
    two_processes(config, tmp_path / "two", fsdp=True)
    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    for a, b in zip(one, two, strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    assert results(tmp_path / "two")["per_task"][1]["parallel"] == "fsdp2"
    state_one, state_two = final_state(tmp_path / "one"), final_state(tmp_path / "two")
    for name, tensors in state_one.items():
        for key, value in tensors.items():
            torch.testing.assert_close(state_two[name][key], value, rtol=1e-3, atol=1e-4)


@SLOW
def test_sharded_step_checkpoints_are_whole_and_resume(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Killed inside task 2 after its step-2 checkpoint, two sharded processes leave the file a
    one-process run leaves (weights and AdamW moments gathered whole); the sharded run resumes
    from it, and so do two sharded processes from the one-process run's, as uninterrupted."""
    train = {"steps": 6, "batch_size": 8, "lr": 1e-3, "max_length": 32, "checkpoint_every": 2}
    config = write_config(tmp_path, tiny_run_config(tiny_model_dir, train=train))
    cli(config, tmp_path / "full")
    killed_at("step", 6 + 4, config, tmp_path / "one")
    two_processes(config, tmp_path / "two", fsdp=True, killed_at=("step", 6 + 4))
    step = Path("checkpoints") / "step-02-cipher" / "step_state.safetensors"
    saved_one, saved_two = (
        load_file(str(tmp_path / "one" / step)),
        load_file(str(tmp_path / "two" / step)),
    )
    assert saved_one.keys() == saved_two.keys() and any(k.startswith("optim/") for k in saved_one)
    for key, value in saved_one.items():
        if not key.startswith("rng/"):
            torch.testing.assert_close(saved_two[key], value, rtol=1e-4, atol=1e-6)
    for out in (tmp_path / "two", tmp_path / "one"):
        two_processes(config, out, fsdp=True)
        assert results(out)["per_task"][1]["parallel"] == "fsdp2"
        for a, b in zip(step_losses(tmp_path / "full"), step_losses(out), strict=True):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
        for name, tensors in final_state(tmp_path / "full").items():
            for key, value in tensors.items():
                torch.testing.assert_close(final_state(out)[name][key], value, rtol=1e-3, atol=1e-4)


def _lora_runs_match_one(
    raw: dict[str, Any], tmp_path: Path, resume: bool = True
) -> dict[str, Any]:
    """One process, two sharded ones, and (with ``resume``) a run killed on one process after
    task 1 resumed on two sharded ones: every step loss and every saved tensor alike. The
    one-process state."""
    config = write_config(tmp_path, raw)
    cli(config, tmp_path / "one")
    two_processes(config, tmp_path / "two", fsdp=True)
    outs = [tmp_path / "two"]
    if resume:
        killed_at("between_tasks", 1, config, tmp_path / "resumed")
        two_processes(config, tmp_path / "resumed", fsdp=True)
        outs.append(tmp_path / "resumed")
    state_one = final_state(tmp_path / "one")
    for out in outs:
        assert results(out)["per_task"][-1]["parallel"] == "fsdp2"
        for a, b in zip(step_losses(tmp_path / "one"), step_losses(out), strict=True):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
        assert final_state(out).keys() == state_one.keys()
        for name, tensors in state_one.items():
            for key, value in tensors.items():
                torch.testing.assert_close(final_state(out)[name][key], value, rtol=1e-3, atol=1e-5)
    return state_one


def test_lora_runs_sharded_as_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The fast tier's sharded LoRA run. The adapter's wrapper is the FSDP root, so the base is
    measured and every row generated through it (the inner model's weights are shards)."""
    raw = _config(tiny_model_dir, "seq_ft", "lora")
    raw["finetune"]["lora"]["regime"] = "carry"
    _lora_runs_match_one(raw, tmp_path, resume=False)


@SLOW
def test_a_budget_rolls_back_sharded_as_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A forgetting budget tight enough to roll back, on LoRA shards: the rollback copies into
    FSDP2's shards, and the checks, the knob's path and the weights match one process (the
    knob to 1e-3: it moves with a KL of about 5e-5, measured on shards)."""
    raw = _config(tiny_model_dir, "kl_sft", "lora")
    raw["finetune"]["lora"]["regime"] = "carry"
    raw["budget"] = {"metric": "kl_to_base", "max_loss": 5e-5, "probe_batch": 8}
    _lora_runs_match_one(raw, tmp_path, resume=False)
    traces = [
        [t["budget"]["trace"] for t in results(tmp_path / out)["per_task"]]
        for out in ("one", "two")
    ]
    assert any(e.get("rolled_back") for task in traces[0] for e in task)
    for a, b in zip(traces[0], traces[1], strict=True):
        assert [e.get("rolled_back") for e in b] == [e.get("rolled_back") for e in a]
        assert [e["next"] for e in b] == pytest.approx([e["next"] for e in a], rel=1e-3)


@SLOW
def test_lora_carry_runs_sharded_and_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """LoRA in the carry regime: its adapter is attached before the split and sharded with its
    layer; two processes match one, the saved adapter is whole, and a run killed on one process
    after task 1 resumes on two sharded ones."""
    raw = _config(tiny_model_dir, "seq_ft", "lora")
    raw["finetune"]["lora"]["regime"] = "carry"
    state_one = _lora_runs_match_one(raw, tmp_path)
    assert any("lora_B" in key for tensors in state_one.values() for key in tensors)


@SLOW
def test_lora_per_task_runs_sharded_and_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """O-LoRA in the per_task regime: every task's adapter is attached before the split, each
    under its task's seed, and joins the forward pass when its task begins; its orthogonality
    term (made large here, so a wrong scale of its sharded gradient would show) is computed on
    the gathered A matrices. Two processes match one, also resumed after task 1."""
    raw = _config(tiny_model_dir, "o_lora", "lora")
    raw["method"]["lambda_orth"] = 1e3
    state_one = _lora_runs_match_one(raw, tmp_path)
    adapters = {f"adapters/task_{i}/adapter_model.safetensors" for i in (1, 2)}
    assert adapters <= set(state_one)
    assert results(tmp_path / "one")["per_task"][1]["loss_terms"]["orthogonality"] > 0


@SLOW
def test_two_processes_first_loading_a_gguf_model_convert_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a fresh cache the main process converts the file and the other reads its folder; a
    process that converted into its own scratch copy first would load a folder not yet there."""
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf")
    raw = tiny_run_config(
        tmp_path / "tiny.gguf", train={"steps": 2, "batch_size": 4, "max_length": 64}
    )
    two_processes(write_config(tmp_path, raw), tmp_path / "two")
    assert {t["parallel"] for t in results(tmp_path / "two")["per_task"]} == {"ddp"}
    assert len(list((tmp_path / "cache" / "models").glob("gguf-*/model.safetensors"))) == 1
