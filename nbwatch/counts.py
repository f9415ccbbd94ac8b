"""What counts as a count or a number in a setting: numpy's scalars (read from a config)
as well as Python's, never a bool."""

from __future__ import annotations

import numbers
from typing import Any


def integral(v: Any) -> bool:
    """An int, numpy's included, but not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def real(v: Any) -> bool:
    """A number, numpy's included, but not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)
