"""The house has floors that only look down: no import runs from a module to one on a higher
floor, and no modules import each other in a circle (TYPE_CHECKING and function-level imports
count too, and so does ``importlib.import_module`` of a module named in the code). A module whose
name is not in the code (``import_module(name)``, an entry point) is loaded only by the loaders
named in ``LOADERS``, none below the methods floor. The floors, from the ground up, are the ones
docs/architecture.md describes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import forgetless

SRC = Path(forgetless.__file__).parent
FLOORS: list[tuple[int, str]] = [
    (0, "forgetless.errors"),
    (0, "forgetless.strict"),
    (0, "forgetless.core"),
    (1, "forgetless.config"),
    (2, "forgetless.tasks"),
    (3, "forgetless.eval"),
    (4, "forgetless.contract"),
    (5, "forgetless.models"),
    (5, "forgetless.attribution"),
    (5, "forgetless.sae"),
    (5, "forgetless.merging"),
    (5, "forgetless.diagnostics.geometry"),
    (5, "forgetless.diagnostics.circuits"),
    (5, "forgetless.diagnostics.circuit_metrics"),
    (6, "forgetless.experimental"),
    (8, "forgetless.experimental.methods"),
    (7, "forgetless.engine"),
    (8, "forgetless.methods"),
    (9, "forgetless.training"),
    (9, "forgetless.bench"),
    (9, "forgetless.testing"),
    (9, "forgetless.integrations"),
    (10, "forgetless.diagnostics"),
    (10, "forgetless.report"),
    (11, "forgetless.cli"),
    (11, "forgetless.__main__"),
    (12, "forgetless"),
]


LOADERS = {
    "forgetless": "the public names, each loaded on first use",
    "forgetless.methods": "the registry's finder: a built-in's module, or an entry point",
}
"""The modules that may load a module whose name is not written in the code, and what they load."""
LOADING_CALLS = {"import_module", "__import__", "entry_points", "exec_module", "load_module"}


def floor(module: str) -> int:
    """The floor of the longest prefix of ``module`` in FLOORS."""
    best = max(
        (p for p in FLOORS if module == p[1] or module.startswith(p[1] + ".")),
        key=lambda p: len(p[1]),
    )
    return best[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _target(node: ast.ImportFrom, alias: ast.alias) -> str:
    """The module an ``from X import y`` reaches: ``X.y`` when ``y`` is a submodule."""
    full = f"{node.module}.{alias.name}"
    as_path = SRC.parent / full.replace(".", "/")
    return full if as_path.with_suffix(".py").is_file() or as_path.is_dir() else str(node.module)


def _imported_by_name(node: ast.AST) -> str | None:
    """The module of an ``import_module("forgetless…")`` call with a literal name, or None."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    func, arg = node.func, node.args[0]
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
    if name == "import_module" and literal and str(arg.value).startswith("forgetless"):  # type: ignore[union-attr]
        return str(arg.value)  # type: ignore[union-attr]
    return None


def _loads_by_unwritten_name(node: ast.AST) -> bool:
    """A call that loads a module named at run time: ``import_module``/``__import__`` of
    anything but a literal, entry points, or a module executed from a spec."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name not in LOADING_CALLS:
        return False
    literal = bool(node.args) and isinstance(node.args[0], ast.Constant)
    return name not in ("import_module", "__import__") or not literal


def loads_by_unwritten_name() -> dict[str, list[int]]:
    """Each module's lines that load a module named at run time."""
    found: dict[str, list[int]] = {}
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        lines = [n.lineno for n in ast.walk(tree) if _loads_by_unwritten_name(n)]  # type: ignore[attr-defined]
        if lines:
            found[module_name(path)] = sorted(lines)
    return found


def imports() -> dict[str, set[str]]:
    """Every module's forgetless imports, wherever they stand in the file."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("forgetless"):
                found |= {_target(node, a) for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("forgetless")}
            elif (named := _imported_by_name(node)) is not None:
                found.add(named)
        graph[module_name(path)] = found
    return graph


def test_no_import_runs_upward() -> None:
    upward = sorted(
        f"{a} (floor {floor(a)}) -> {b} (floor {floor(b)})"
        for a, targets in imports().items()
        for b in targets
        if floor(b) > floor(a)
    )
    assert not upward, "\n".join(upward)


def test_only_the_loaders_load_a_module_named_at_run_time() -> None:
    """A floor cannot hide an upward import behind a name it computes (the registry once
    imported ``forgetless.methods.<name>`` from floor 0): only ``LOADERS`` may, and none of
    them stands below the methods floor."""
    hidden = sorted(
        f"{module} (floor {floor(module)}), line {line}"
        for module, lines in loads_by_unwritten_name().items()
        if module not in LOADERS
        for line in lines
    )
    assert not hidden, "loads a module named at run time:\n" + "\n".join(hidden)
    assert all(floor(m) >= floor("forgetless.methods") for m in LOADERS)


def test_nothing_stable_reaches_into_the_experimental_corner() -> None:
    """The experimental corner plugs in through entry points (``pyproject.toml``), as an outside
    package would: no stable module imports it or names its modules, docstrings included."""
    corner = "forgetless.experimental"
    reaching = sorted(
        f"{a} -> {b}"
        for a, targets in imports_cache.items()
        if not (a == corner or a.startswith(corner + "."))
        for b in targets
        if b == corner or b.startswith(corner + ".")
    )
    assert not reaching, "\n".join(reaching)
    stems = {p.stem for p in (SRC / "experimental").rglob("*.py")} - {"__init__", "methods"}
    words = re.compile(r"\b(" + "|".join(map(re.escape, sorted(stems))) + r")\b", re.IGNORECASE)
    naming = sorted(
        f"{path.relative_to(SRC)}: {found.group(0)}"
        for path in SRC.rglob("*")
        if path.is_file()
        and path.suffix in (".py", ".md", ".txt", ".json", ".yaml")
        and "experimental" not in path.relative_to(SRC).parts
        and (found := words.search(path.read_text(encoding="utf-8", errors="replace")))
    )
    assert not naming, "\n".join(naming)


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node], _ = 2, stack.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_circles() -> None:
    graph = {
        a: {b for b in targets if b in imports_cache and b != a}
        for a, targets in imports_cache.items()
    }
    circle = _circle(graph)
    assert circle is None, " -> ".join(circle or [])


def test_the_check_catches_an_upward_import_and_a_circle() -> None:
    assert floor("forgetless.core.storage") < floor("forgetless.contract.method")
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None
    call = ast.parse('importlib.import_module("forgetless.experimental.gcwm")').body[0]
    assert _imported_by_name(call.value) == "forgetless.experimental.gcwm"  # type: ignore[attr-defined]
    assert _imported_by_name(ast.parse("import_module(name)").body[0].value) is None  # type: ignore[attr-defined]
    dynamic = ["importlib.import_module(name)", "__import__(f'x.{y}')", "entry_points(group=g)"]
    assert all(_loads_by_unwritten_name(ast.parse(c).body[0].value) for c in dynamic)  # type: ignore[attr-defined]
    assert not _loads_by_unwritten_name(ast.parse('import_module("json")').body[0].value)  # type: ignore[attr-defined]


def test_every_module_has_a_floor() -> None:
    assert all(floor(m) >= 0 for m in imports())


imports_cache = imports()
