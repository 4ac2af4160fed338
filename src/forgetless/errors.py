"""User-facing errors: one line that names the place, and exit code 2 at the CLI."""

from __future__ import annotations


class ForgetlessError(Exception):
    """An error caused by the user's input (config, data, paths); printed as one line."""

    exit_code = 2


class ConfigError(ForgetlessError):
    """The configuration is malformed or inconsistent."""


class DataError(ForgetlessError):
    """A dataset or data file cannot be read or has a malformed record."""


class ModelLoadError(ForgetlessError):
    """A model or tokenizer cannot be loaded."""


class CheckpointError(ForgetlessError):
    """A checkpoint cannot be read: missing, truncated, corrupted, or from another model."""


class TrainingError(ForgetlessError):
    """Training cannot go on (e.g. a non-finite loss)."""


class EnvironmentFault(ForgetlessError):
    """The machine, not the input, is at fault (disk full, permissions, a busy output folder)."""

    exit_code = 1
