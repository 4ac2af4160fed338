"""LLaMA Pro block expansion: identity copies above each group, only they train, full FT only."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import TINY, tiny_run_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel
from typer.testing import CliRunner

from forgetless.cli.app import app
from forgetless.config.loading import validate_config
from forgetless.errors import ConfigError
from forgetless.methods.block_expansion import (
    BlockExpansion,
    BlockExpansionConfig,
    default_new_blocks,
    expand_blocks,
    expansion_sources,
)
from forgetless.models.tiny import build_tiny_model
from forgetless.testing import task_context


def tiny(arch: str, layers: int = 4) -> PreTrainedModel:
    config = TINY.model_copy(update={"arch": arch, "num_layers": layers})
    return build_tiny_model(config, vocab_size=99, seed=0).eval()


def test_one_new_block_above_the_top_of_each_group() -> None:
    assert expansion_sources(32, 8) == [3, 7, 11, 15, 19, 23, 27, 31]  # the paper's 32 -> 40
    assert expansion_sources(4, 2) == [1, 3]
    assert expansion_sources(4, 1) == [3]
    with pytest.raises(ValueError, match=r"num_new_blocks=3 .* 4 decoder layers .*1, 2, 4\)"):
        expansion_sources(4, 3)
    assert [default_new_blocks(n) for n in (32, 30, 28, 24, 4, 2, 1)] == [8, 6, 7, 6, 1, 1, 1]


@pytest.mark.parametrize("num_new", [1, 2])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_expanded_model_computes_what_the_base_did(arch: str, num_new: int) -> None:
    base = tiny(arch)
    model = copy.deepcopy(base)
    new = expand_blocks(model, num_new)
    assert new == ([4] if num_new == 1 else [2, 5])
    assert model.config.num_hidden_layers == len(model.model.layers) == 4 + num_new
    types = getattr(model.config, "layer_types", None)
    assert types is None or len(types) == 4 + num_new
    ids = torch.randint(4, 99, (2, 12))
    with torch.no_grad():
        assert (model(ids).logits - base(ids).logits).abs().max() <= 1e-6


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_cached_generation_and_a_reload_see_the_expanded_stack(arch: str, tmp_path: Path) -> None:
    base = tiny(arch)
    model = copy.deepcopy(base)
    expand_blocks(model, 2)
    assert [block.self_attn.layer_idx for block in model.model.layers] == list(range(6))
    prompt = torch.randint(4, 99, (2, 5))
    with torch.no_grad():  # every step's logits, read through the KV cache
        got, want = (
            m.generate(
                prompt,
                max_new_tokens=6,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            for m in (model, base)
        )
    assert torch.equal(got.sequences, want.sequences)
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(got.logits, want.logits, strict=True))
    model.save_pretrained(str(tmp_path))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert len(reloaded.model.layers) == 6
    with torch.no_grad():
        assert torch.equal(reloaded(prompt).logits, model(prompt).logits)


def test_only_the_new_blocks_get_gradients_and_expansion_happens_once() -> None:
    model = tiny("qwen2", layers=2)
    method = BlockExpansion(BlockExpansionConfig(num_new_blocks=1))
    method.on_task_start(task_context(model, ["reverse", "cipher"], index=1))
    method.on_task_start(task_context(model, ["reverse", "cipher"], index=2))
    assert len(model.model.layers) == 3
    ids = torch.randint(4, 99, (2, 12))
    model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        if name.startswith("model.layers.2."):
            assert param.requires_grad and param.grad is not None, name
        else:
            assert not param.requires_grad and param.grad is None, name
    zeroed = model.model.layers[2].self_attn.o_proj.weight
    assert zeroed.grad is not None and zeroed.grad.abs().sum() > 0


def test_lora_is_refused_at_validate_in_one_line(tiny_model_dir: Path) -> None:
    raw = tiny_run_config(
        tiny_model_dir, method={"name": "block_expansion"}, finetune={"mode": "lora"}
    )
    with pytest.raises(ConfigError) as refused:
        validate_config(raw)
    line = str(refused.value)
    assert "\n" not in line
    assert "method 'block_expansion'" in line and "it needs finetune.mode full" in line


def test_a_count_that_does_not_divide_the_stack_is_one_line() -> None:
    method = BlockExpansion(BlockExpansionConfig(num_new_blocks=3))
    with pytest.raises(ConfigError, match=r"^method 'block_expansion': num_new_blocks=3 must"):
        method.on_task_start(task_context(tiny("llama", layers=2), ["reverse"]))


def test_a_tiny_forgetless_run_trains_only_the_new_block(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    raw = tiny_run_config(
        tiny_model_dir, method={"name": "block_expansion", "num_new_blocks": 1}, probes=[]
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(config), "--out", str(tmp_path / "o"), "--quiet"])
    assert result.exit_code == 0, result.output
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    ckpt = next((tmp_path / "o" / "checkpoints").glob("task-02-*"))
    trained = load_file(str(ckpt / "model.safetensors"))
    new = {k for k in trained if k.startswith("model.layers.2.")}
    assert new and all(k.replace(".2.", ".1.") in base for k in new)  # a copy of layer 1
    assert not torch.equal(trained["model.layers.2.self_attn.o_proj.weight"], torch.zeros(32, 32))
    kept = [k for k in base if k in trained]
    assert any(".layers.1." in k for k in kept)
    assert all(torch.equal(base[k], trained[k]) for k in kept)  # the original weights stay put


class CutAtTaskTwo(BlockExpansion):
    """block_expansion, interrupted as its second task starts (after task 1's checkpoint)."""

    def on_task_start(self, ctx: Any) -> None:
        if ctx.task_index == 2:
            raise KeyboardInterrupt
        super().on_task_start(ctx)


def test_a_run_cut_after_a_task_resumes_and_exports(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The expansion comes before saved weights are read: a resumed run equals an
    uninterrupted one, and export writes the expanded model."""
    from rich.console import Console

    from forgetless.training.export import export_model
    from forgetless.training.runner import Runner

    method = {"name": "block_expansion", "num_new_blocks": 1}
    cfg = validate_config(tiny_run_config(tiny_model_dir, method=method, probes=[]))

    def run(out: Path, with_method: Any = None) -> dict[str, Any]:
        runner = Runner(cfg, out, Console(quiet=True), progress=False, method=with_method)
        return runner.run().to_json()

    full = run(tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", CutAtTaskTwo(BlockExpansionConfig(**method)))
    resumed = run(tmp_path / "cut")
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    export_model(tmp_path / "cut", tmp_path / "exported")
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert any(k.startswith("model.layers.2.") for k in exported)
