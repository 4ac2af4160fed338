"""The collectives on 2 gloo processes, the shipped accelerate configs, and refused launches."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from accelerate.commands.config.config_args import ClusterConfig
from safetensors.torch import load_file

from forgetless.core import distributed, zero
from forgetless.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "accelerate"


def _worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        state = {
            "fisher": {"w": torch.tensor([1.0, 2.0]) * (rank + 1)},
            "importance": torch.tensor([0.1, 0.9]) if rank else torch.tensor([0.5, 0.2]),
            "anchor": torch.tensor([float(rank)]),
            "lam": 0.5,
        }
        reduced = distributed.reduce_state(state, {"fisher": "mean", "importance": "max"})
        shards = distributed.shard(list(range(5)))
        value = distributed.weighted_sum(torch.tensor([2.0 + rank]), 0.25 if rank else 0.75)
        with distributed.local_only():
            local = (distributed.world_size(), distributed.shard([1, 2, 3]))
        record = {
            "fisher": reduced["fisher"]["w"].tolist(),
            "importance": reduced["importance"].tolist(),
            "anchor": reduced["anchor"].tolist(),
            "lam": reduced["lam"],
            "shard": shards,
            "weighted": value.item(),
            "local": [local[0], local[1]],
        }
        Path(out, f"{rank}.json").write_text(json.dumps(record), encoding="utf-8")
        dist.barrier()  # no rank tears gloo down while the other's last collective drains
    finally:
        dist.destroy_process_group()


def _on_two_processes(worker: Any, folder: Path) -> list[dict[str, Any]]:
    """Run ``worker(rank, init, folder)`` on 2 gloo processes; each writes ``RANK.json``."""
    init = f"file://{folder / 'rendezvous'}"
    mp.spawn(worker, args=(init, str(folder)), nprocs=2, join=True)
    return [json.loads((folder / f"{r}.json").read_text()) for r in (0, 1)]


def test_collectives_on_two_processes(tmp_path: Path) -> None:
    got = _on_two_processes(_worker, tmp_path)
    for rank, record in enumerate(got):
        assert record["fisher"] == [1.5, 3.0]  # mean of 1× and 2×
        assert record["importance"] == pytest.approx([0.5, 0.9])  # element-wise max
        assert record["anchor"] == [float(rank)]  # no op named: left as it is
        assert record["lam"] == 0.5
        assert record["weighted"] == pytest.approx(0.75 * 2.0 + 0.25 * 3.0)
        assert record["local"] == [1, [1, 2, 3]]
    assert got[0]["shard"] + got[1]["shard"] == [0, 1, 2, 3, 4]
    assert [len(r["shard"]) for r in got] == [3, 2]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_accelerate_configs_fit_the_schema(path: Path) -> None:
    """On this GPU-less machine the GPU configs can only be checked against accelerate's schema."""
    cfg = ClusterConfig.from_yaml_file(str(path))
    kind = str(cfg.distributed_type).rsplit(".", 1)[-1]
    assert kind in ("MULTI_GPU", "FSDP", "DEEPSPEED")
    if kind == "FSDP":  # the only form of FSDP forgetless runs
        assert cfg.fsdp_config["fsdp_version"] == 2
    if kind == "DEEPSPEED":  # ZeRO-3 splits the weights: refused
        assert cfg.deepspeed_config["zero_stage"] in (1, 2)
    assert cfg.num_processes >= 2
    assert cfg.num_processes % cfg.num_machines == 0


@pytest.mark.parametrize(
    ("kind", "why"),
    [("FSDP", "FSDP version 1 is not supported"), ("DEEPSPEED", "DEEPSPEED is not supported")],
)
def test_an_unsupported_sharded_launch_is_refused_in_one_line(
    monkeypatch: Any, kind: str, why: str
) -> None:
    fake = SimpleNamespace(distributed_type=f"DistributedType.{kind}", device=torch.device("cpu"))
    monkeypatch.setattr(distributed, "PartialState", lambda **_: fake)
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    with pytest.raises(ConfigError, match=rf"distributed_type {kind}: {why}") as err:
        distributed.start()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("stage", "installed", "why"),
    [
        ("3", True, "ZeRO-3 is not supported: it splits the weights"),
        ("2", False, "needs deepspeed, which is not installed"),
        ("1", False, "needs deepspeed, which is not installed"),
    ],
)
def test_a_deepspeed_launch_it_cannot_run_is_refused_in_one_line(
    monkeypatch: Any, stage: str, installed: bool, why: str
) -> None:
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", stage)
    monkeypatch.setattr(zero.importlib.util, "find_spec", lambda name: installed or None)
    with pytest.raises(ConfigError, match=why) as err:
        distributed.start()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("stage", ["1", "2"])
def test_a_zero_launch_goes_through_deepspeed(monkeypatch: Any, stage: str) -> None:
    """ZeRO-1/2 start accelerate's state on DeepSpeed's side (cpu=False: DS_ACCELERATOR picks
    its CPU backend), and the layout names the stage."""
    calls: list[dict[str, Any]] = []
    fake = SimpleNamespace(distributed_type="DistributedType.DEEPSPEED", device="cpu")
    monkeypatch.setattr(distributed, "PartialState", lambda **kw: calls.append(kw) or fake)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", stage)
    monkeypatch.setattr(zero.importlib.util, "find_spec", lambda name: True)
    assert distributed.start() is fake and calls == [{"cpu": False}]
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    assert distributed.layout() == f"zero{stage}"


def test_the_engine_gets_the_loops_batch_and_clipping() -> None:
    assert zero.ds_settings(8, 2, 1.0) == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 8,
        "gradient_clipping": 1.0,
    }
    assert zero.ds_settings(5, 2, None)["train_micro_batch_size_per_gpu"] == 3
    assert zero.ds_settings(8, 2, None)["gradient_clipping"] == 0.0  # DeepSpeed's "none"


def test_what_cannot_go_through_the_zero_engine_is_named() -> None:
    from forgetless.core import registry

    assert registry.zero_rule_broken(registry.lookup("seq_ft"), False, None) is None
    assert "TRL" in (registry.zero_rule_broken(registry.lookup("rl"), False, None) or "")
    budget = registry.zero_rule_broken(registry.lookup("seq_ft"), True, None) or ""
    assert budget.startswith("budget does not run under DeepSpeed ZeRO")
    steps = registry.zero_rule_broken(registry.lookup("ewc"), False, 10) or ""
    assert steps.startswith("train.checkpoint_every does not run under DeepSpeed ZeRO")


def test_a_sharded_launch_is_read_from_accelerates_flags(monkeypatch: Any) -> None:
    """PartialState says MULTI_CPU under `accelerate launch --use_fsdp` on CPU: the launch's own
    flags decide (FSDP version 2 runs sharded, version 1 is refused), never a silently
    replicated run. (DeepSpeed's flag is read the same way, by the tests above.)"""
    fake = SimpleNamespace(distributed_type="DistributedType.MULTI_CPU", device=torch.device("cpu"))
    monkeypatch.setattr(distributed, "PartialState", lambda **_: fake)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match=r"distributed_type FSDP: "):
        distributed.start()
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert distributed.start() is fake  # sharded by the runner
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert distributed.start() is fake


def test_cpu_launch_without_mpi_is_warned_about(monkeypatch: Any) -> None:
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert "started 1 process" in (distributed.launch_warning() or "")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.launch_warning() is None


def test_a_batch_smaller_than_the_processes_is_refused(monkeypatch: Any) -> None:
    monkeypatch.setattr(distributed, "world_size", lambda: 4)
    with pytest.raises(ConfigError, match="task 'x': batch_size 2 is smaller than the 4"):
        distributed.check_batch(2, "task 'x'")


def _tiny_tied(seed: int) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def _shard_worker(rank: int, init: str, out: str) -> None:
    from safetensors.torch import save_file

    from forgetless.core import sharding

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        trained = sharding.shard_model(_tiny_tied(0))
        full = sharding.full_state(trained)
        if rank == 0:
            assert full is not None
            save_file(full, str(Path(out, "full.safetensors")))
        dist.barrier()
        fresh = sharding.shard_model(_tiny_tied(1))
        stored = load_file(str(Path(out, "full.safetensors")))
        sharding.load_full_state(fresh, stored, "full.safetensors")
        same = all(
            torch.equal(a.full_tensor(), b.full_tensor())
            for a, b in zip(trained.state_dict().values(), fresh.state_dict().values(), strict=True)
        )
        shard = next(fresh.parameters())
        name = next(n for n, _ in fresh.named_parameters())
        state = {"fisher": {name: torch.arange(512.0).view(32, 16)}, "lam": 2.0, "other": {}}
        split = sharding.shard_state_like(state, fresh)
        back = sharding.gather_state(split)
        record = {
            "same": same,
            "local": list(sharding.local(shard).shape),
            "state_local": list(sharding.local(split["fisher"][name]).shape),
            "state_back": bool(torch.equal(back["fisher"][name], state["fisher"][name])),
        }
        Path(out, f"{rank}.json").write_text(json.dumps(record), encoding="utf-8")
        dist.barrier()  # no rank tears gloo down while the other's last collective drains
    finally:
        dist.destroy_process_group()


def test_a_sharded_model_is_gathered_to_one_file_and_split_again(tmp_path: Path) -> None:
    got = _on_two_processes(_shard_worker, tmp_path)
    assert all(r["same"] for r in got)
    assert [r["local"] for r in got] == [[16, 16], [16, 16]]  # half of the 32 × 16 embedding
    assert [r["state_local"] for r in got] == [[16, 16], [16, 16]]  # state split like its weight
    assert all(r["state_back"] for r in got)  # and gathered whole for saving
    names = set(load_file(str(tmp_path / "full.safetensors")))
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names  # tied: once


def test_cluster_settings_are_checked_before_anything_is_submitted(tmp_path: Path) -> None:
    from forgetless.bench.cluster import run_on_cluster
    from forgetless.bench.variants import ClusterSection
    from forgetless.config.loading import validate_config

    with pytest.raises(ConfigError, match="bench --cluster: 'pbs' is not one of slurm, local"):
        run_on_cluster([], "pbs", ClusterSection(), tmp_path, lambda *_: None)
    typo = {"tasks": ["reverse"], "bench": {"cluster": {"partitoin": "gpu"}}}
    with pytest.raises(ConfigError, match=r"c\.yaml: bench.*cluster\.partitoin") as err:
        validate_config(typo, "c.yaml")
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())  # no job folder was made


def test_a_parameter_term_is_left_alone_unless_sharded(monkeypatch: Any) -> None:
    value = torch.tensor(3.0)
    assert distributed.parameter_term(value, 0.25) is value  # one process, or DDP
    monkeypatch.setattr(distributed, "sharded", lambda: True)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    shares = (0.25, 0.75)  # what each process scales by share × 2 afterwards
    scaled = [
        float(distributed.scale_for_reduction(distributed.parameter_term(value, s), s))
        for s in shares
    ]
    assert scaled == [3.0, 3.0]  # each shard gets the term's own gradient
    logged = sum(s * float(distributed.parameter_term(value, s)) for s in shares)
    assert logged == pytest.approx(3.0)  # and the token-share-weighted log is the term
