"""Methods still in the experimental corner, declared through forgetless's own entry points
(``forgetless.methods`` in ``pyproject.toml``) like an outside package's: their import warns once,
when a config first names one, never in the middle of a task."""
