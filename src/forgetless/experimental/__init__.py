"""Incubating methods whose tests and benchmarks do not yet show they work; APIs may change.

Importing this package warns once (as TRL's ``trl.experimental`` does).
"""

import warnings


class ExperimentalWarning(UserWarning):
    """forgetless.experimental is in use."""


warnings.warn(
    "forgetless.experimental is experimental: its methods and APIs may change without notice",
    ExperimentalWarning,
    stacklevel=2,
)
