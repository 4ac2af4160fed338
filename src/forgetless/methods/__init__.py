"""Forgetting-control methods, one module each (the interface is ``forgetless.contract``), and
the one place the registry finds a method it does not hold yet.

``BUILTIN`` lists the built-ins, each by the module that declares it, imported only when its name
is first looked up: validating a config imports the one method it names. Any other package (the
experimental corner included, through forgetless's own ``pyproject.toml``) declares its methods
in the entry-point group ``forgetless.methods``, as pytest plugins do in ``pytest11``. Importing
this package installs the finder into ``forgetless.core.registry``; ``forgetless/__init__.py``
imports it, so every entry into the package has it.
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points

from forgetless.core import registry
from forgetless.errors import ConfigError

BUILTIN: dict[str, str] = {
    "anchored": "forgetless.methods.anchored",
    "asft": "forgetless.methods.asft",
    "attribution_gate": "forgetless.methods.attribution_gate",
    "block_expansion": "forgetless.methods.block_expansion",
    "dft": "forgetless.methods.dft",
    "eaft": "forgetless.methods.eaft",
    "ewc": "forgetless.methods.ewc",
    "freeze": "forgetless.methods.freeze",
    "kl_sft": "forgetless.methods.kl_sft",
    "low_lr": "forgetless.methods.low_lr",
    "mtl": "forgetless.methods.mtl",
    "o_lora": "forgetless.methods.o_lora",
    "opcm": "forgetless.methods.opcm",
    "replay": "forgetless.methods.replay",
    "rl": "forgetless.methods.rl",
    "sae_fd": "forgetless.methods.sae_fd",
    "sdft": "forgetless.methods.sdft",
    "self_sft": "forgetless.methods.self_sft",
    "seq_ft": "forgetless.methods.seq_ft",
    "task_arithmetic": "forgetless.methods.task_arithmetic",
    "ties": "forgetless.methods.ties",
}
"""Every stable built-in method: its name and the module that declares it."""


def _builtin(group: str) -> dict[str, str]:
    return BUILTIN if group == registry.METHODS else {}


def declared(group: str) -> list[str]:
    """The built-ins of ``group``, then every name an installed package declares in it."""
    builtin = _builtin(group)
    return [*builtin, *(p.name for p in entry_points(group=group) if p.name not in builtin)]


def load(group: str, name: str) -> None:
    """Import the module that declares ``name``: a built-in's, else the entry point's (a
    built-in's name is never taken from an entry point)."""
    module = _builtin(group).get(name)
    if module is not None:
        importlib.import_module(module)
        return
    for point in entry_points(group=group, name=name):
        _load(point)


def _load(point: EntryPoint) -> None:
    """Load one entry point; a failure or a mismatched name is one ConfigError line."""
    where = f"entry point {point.name} = {point.value} (group {point.group})"
    try:
        loaded = point.load()
    except Exception as err:  # an outside package's import may fail in any way
        raise ConfigError(f"{where} failed to load: {type(err).__name__}: {err}") from err
    declared_as = getattr(loaded, "name", point.name)
    if isinstance(declared_as, str) and declared_as != point.name:
        raise ConfigError(f"{where} declares {declared_as!r}, not {point.name!r}")


registry.install_finder(registry.Finder(names=declared, load=load))
