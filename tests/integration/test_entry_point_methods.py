"""A method from an installed package, found through the entry-point group ``forgetless.methods``.

Each test puts a throwaway distribution on the path: a module that declares a method, and a
``*.dist-info`` folder whose ``entry_points.txt`` names it, as ``pip install`` would leave them.
The commands run in a fresh interpreter, so what finds the method is the real entry-point scan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import tiny_run_config

from forgetless.core import registry
from forgetless.errors import ConfigError

METHOD_MODULE = '''
"""An outside package's method: an L2 penalty on the trainable weights, a named loss term."""

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from forgetless import Capability, Method, MethodConfig, Paper, declare_method


class ShrinkConfig(MethodConfig):
    name: Literal["shrink"] = Field("shrink", description="L2 on the trainable weights.")
    strength: float = Field(1e-3, ge=0, description="λ on Σ ‖θ‖².")


@declare_method(
    ShrinkConfig,
    capabilities={Capability.LOSS_TERMS},
    paper=Paper("A Paper Made Up for a Test", "Nobody et al.", 2026),
)
class Shrink(Method[ShrinkConfig]):
    """λ·Σ ‖θ‖² over the trainable weights, logged as the loss term ``shrink``."""

    smoke: ClassVar[dict[str, Any]] = {"strength": 1e-4}

    def loss_terms(self, batch: Any, outputs: Any, ctx: Any) -> dict[str, torch.Tensor]:
        weights = [p for p in ctx.task.model.parameters() if p.requires_grad]
        return {"shrink": self.config.strength * sum(p.pow(2).sum() for p in weights)}
'''
SMALL_TRAIN = {"steps": 2, "batch_size": 4, "lr": 1e-3, "max_length": 32}
SMALL_EVAL = {"n_eval": 4, "n_train": 16, "batch_size": 8, "kl_drift": False}


def fake_distribution(root: Path, package: str, source: str, entry_points: str) -> Path:
    """``root`` as a site folder holding ``package`` (one module) and its ``dist-info``."""
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text(source, encoding="utf-8")
    info = root / f"{package}-0.1.dist-info"
    info.mkdir()
    name = package.replace("_", "-")
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n", encoding="utf-8"
    )
    (info / "entry_points.txt").write_text(entry_points, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_distribution(
        tmp_path_factory.mktemp("site"),
        "forgetless_shrink",
        METHOD_MODULE,
        "[forgetless.methods]\nshrink = forgetless_shrink:Shrink\n",
    )


def forgetless_cli(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``forgetless ARGS`` in a fresh interpreter with ``site`` on its path."""
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "COLUMNS": "250", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "forgetless", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_methods_lists_an_installed_packages_method(site: Path, tmp_path: Path) -> None:
    done = forgetless_cli(site, "methods", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if "shrink" in line)
    assert "loss_terms" in row and "L2 on the trainable weights" in row


def test_a_run_naming_it_validates(site: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    method = {"name": "shrink", "strength": 0.25}
    config.write_text(yaml.safe_dump(tiny_run_config(tiny_model_dir, method=method)), "utf-8")
    done = forgetless_cli(site, "validate", str(config), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "method shrink" in done.stdout
    bad = tmp_path / "bad.yaml"
    method = {"name": "shrink", "strength": -1}
    bad.write_text(yaml.safe_dump(tiny_run_config(tiny_model_dir, method=method)), "utf-8")
    done = forgetless_cli(site, "validate", str(bad), cwd=tmp_path)
    assert done.returncode == 2 and "method.strength" in done.stderr


def test_it_runs_in_bench_beside_a_builtin(
    site: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "bench.yaml"
    data = tiny_run_config(tiny_model_dir, train=SMALL_TRAIN, eval=SMALL_EVAL, probes=[])
    config.write_text(yaml.safe_dump(data), encoding="utf-8")
    out = tmp_path / "out"
    args = ["bench", str(config), "--methods", "seq_ft,shrink@strength=0.01"]
    done = forgetless_cli(site, *args, "--seeds", "1", "--out", str(out), "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    bench = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    assert [r["variant"] for r in bench["rows"]] == ["seq_ft", "shrink@strength=0.01"]
    runs = [json.loads(p.read_text(encoding="utf-8")) for p in out.rglob("results.json")]
    (results,) = [r for r in runs if r["config"]["method"]["name"] == "shrink"]
    assert results["config"]["method"] == {"name": "shrink", "strength": 0.01}
    assert all(task["loss_terms"]["shrink"] > 0 for task in results["per_task"])


def test_a_broken_entry_point_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = fake_distribution(
        tmp_path / "site",
        "forgetless_broken_plugin",
        "raise ImportError('needs a package that is not installed')\n",
        "[forgetless.methods]\nbroken_plugin = forgetless_broken_plugin:Nothing\n"
        "misnamed_plugin = forgetless_broken_plugin_twin:Thing\n",
    )
    twin = broken / "forgetless_broken_plugin_twin.py"
    twin.write_text("class Thing:\n    name = 'another_name'\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(broken))
    assert {"broken_plugin", "misnamed_plugin"} <= set(registry.known_names())
    with pytest.raises(ConfigError, match=r"broken_plugin = .* failed to load: ImportError"):
        registry.lookup("broken_plugin")
    with pytest.raises(ConfigError, match=r"declares 'another_name', not 'misnamed_plugin'"):
        registry.lookup("misnamed_plugin")
