"""Methods are declared once and listed in one place; a name is resolved without importing others.

The built-ins are ``forgetless.methods.BUILTIN``; the experimental corner and outside packages
declare theirs in the entry-point group ``forgetless.methods`` (see
``tests/integration/test_entry_point_methods.py`` for an outside package end to end).
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path
from typing import Any, Literal

import pytest
import tomllib

import forgetless
from forgetless.contract import Capability, Method, MethodConfig, Paper, declare_method
from forgetless.contract.method import method_class
from forgetless.core import registry
from forgetless.methods import BUILTIN
from forgetless.methods.papers import _bibliography, cite

SRC = Path(forgetless.__file__).parent
PYPROJECT = SRC.parents[1] / "pyproject.toml"


def test_the_builtin_table_lists_every_method_file() -> None:
    declared = {}
    for path in (SRC / "methods").glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "@register_method" not in text, f"{path.name}: declare it with @declare_method"
        for config in re.findall(r"@declare_method\(\s*(\w+)", text):
            name = re.search(rf'class {config}\(.*\n\s*name: Literal\["(\w+)"\]', text)
            assert name, f"{path.name}: {config} names no method"
            declared[name.group(1)] = f"forgetless.methods.{path.stem}"
    assert declared == BUILTIN


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_each_builtin_is_declared_under_its_table_name(name: str) -> None:
    cls = method_class(name)
    assert cls.__module__ == BUILTIN[name] and cls.name == name
    assert cls.config_cls.model_fields["name"].annotation == Literal[name]  # type: ignore[valid-type]
    assert cls.paper is None or (isinstance(cls.paper, Paper) and cls.paper.title)


def test_declare_method_says_it_all_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))

    class HomeConfig(MethodConfig):
        name: Literal["home_probe"] = "home_probe"

    paper = Paper("A Title", "Someone et al.", 2024, "arXiv:0000.00000")

    @declare_method(HomeConfig, capabilities={Capability.TASK_START}, paper=paper)
    class Home(Method[HomeConfig]):
        """Does nothing at each task's start."""

        def on_task_start(self, ctx: Any) -> None:
            return None

    assert method_class("home_probe") is Home
    assert (Home.name, Home.config_cls, Home.paper) == ("home_probe", HomeConfig, paper)
    assert Home.capabilities == frozenset({Capability.TASK_START})
    assert str(paper) == 'Someone et al. 2024, "A Title", arXiv:0000.00000'
    assert str(Paper("Untitled")) == '"Untitled"'
    with pytest.raises(TypeError, match="lacks loss_terms"):
        declare_method(HomeConfig, capabilities={Capability.LOSS_TERMS})(
            type("Bare", (Method,), {})
        )
    with pytest.raises(TypeError, match=r"LooseConfig.name must be Literal"):
        declare_method(type("LooseConfig", (MethodConfig,), {}))


def test_an_unknown_name_lists_the_known_ones_without_importing_them() -> None:
    with pytest.raises(KeyError, match=r"unknown method 'ewcc'; known: .*\bewc\b.*\bgcwm\b"):
        method_class("ewcc")


VALIDATE_ONE = """
import sys, warnings
warnings.simplefilter("error")
from forgetless.config.loading import validate_config
from forgetless.core import registry
from forgetless.methods import BUILTIN
validate_config({"tasks": ["reverse"], "method": {"name": "ewc", "lam": 10.0}})
registry.known_names()
method_modules = set(BUILTIN.values())
loaded = sorted(m for m in sys.modules if m in method_modules or m.startswith("forgetless.exp"))
print(loaded)
"""


def test_validating_a_config_imports_only_the_method_it_names() -> None:
    done = subprocess.run(
        [sys.executable, "-c", VALIDATE_ONE], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['forgetless.methods.ewc']"


MERGE_GCWM = """
import warnings
from forgetless.merging.config import MergeConfig
base = {"base_model": "b", "tasks": [{"path": "t"}]}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    MergeConfig.model_validate({**base, "method": {"name": "ties"}})
    print(sorted({w.category.__name__ for w in caught}))
    cfg = MergeConfig.model_validate({**base, "method": {"name": "gcwm", "rank": 4}})
    print(sorted({w.category.__name__ for w in caught}), type(cfg.method).__module__)
"""


def test_the_experimental_corner_is_found_through_entry_points_and_warns() -> None:
    done = subprocess.run(
        [sys.executable, "-c", MERGE_GCWM], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == [
        "[]",
        "['ExperimentalWarning'] forgetless.experimental.gcwm_merge",
    ]


def test_the_installed_entry_points_are_pyprojects() -> None:
    """The experimental corner is found only when the installed metadata is current: after an
    edit of ``pyproject.toml``'s entry points, reinstall (``pip install -e .``)."""
    declared = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["entry-points"]
    installed: dict[str, dict[str, str]] = {}
    for point in distribution("forgetless").entry_points:
        if point.group.startswith("forgetless."):
            installed.setdefault(point.group, {})[point.name] = point.value
    wanted = {g: dict(points) for g, points in declared.items() if g.startswith("forgetless.")}
    assert installed == wanted, "stale install: run `pip install -e .` again"
    assert all(name not in BUILTIN for name in wanted.get("forgetless.methods", {}))


def test_the_bibliography_holds_exactly_the_papers_the_builtins_cite() -> None:
    cited = {method_class(name).paper for name in BUILTIN} - {None}
    assert cited == set(_bibliography().values())


def test_citing_an_unknown_paper_names_the_bibliography() -> None:
    with pytest.raises(KeyError, match=r"papers.toml: no paper 'nobody2020'; known: .*kirkpatrick"):
        cite("nobody2020")
