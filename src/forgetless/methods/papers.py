"""The built-in methods' bibliography (papers.toml beside this file), cited by key in each
method's declaration."""

from __future__ import annotations

import functools
from importlib import resources

import tomllib

from forgetless.contract.method import Paper


@functools.cache
def _bibliography() -> dict[str, Paper]:
    text = resources.files(__package__).joinpath("papers.toml").read_text(encoding="utf-8")
    return {key: Paper(**entry) for key, entry in tomllib.loads(text).items()}


def cite(key: str) -> Paper:
    """The paper ``key`` names in papers.toml (``kirkpatrick2017``)."""
    papers = _bibliography()
    if key not in papers:
        raise KeyError(f"papers.toml: no paper {key!r}; known: {', '.join(sorted(papers))}")
    return papers[key]
