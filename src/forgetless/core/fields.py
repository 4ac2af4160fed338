"""Bounded numbers for config fields, so that a field's type carries its bound:
``lam: NonNegative = Field(1e5, description=...)`` validates, and shows in the JSON schema, as
``Field(1e5, ge=0, ...)`` did."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

NonNegative = Annotated[float, Field(ge=0)]
"""A weight, rate or scale that may be 0 (off)."""
Positive = Annotated[float, Field(gt=0)]
"""A scale, step size or temperature that must be above 0."""
Fraction = Annotated[float, Field(ge=0, le=1)]
"""A share or probability in [0, 1]."""
Count = Annotated[int, Field(ge=1)]
"""How many of something, at least one: steps, examples, a batch size."""
