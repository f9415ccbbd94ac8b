"""What counts as a count or a number in a setting: numpy's scalars (read from a config)
as well as Python's, never a bool; and numpy's scalars stored as the Python ones."""

from __future__ import annotations

import contextlib
import numbers
from typing import Any


def integral(v: Any) -> bool:
    """An int, numpy's included, but not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def real(v: Any) -> bool:
    """A number, numpy's included, but not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def as_python(o: Any) -> Any:
    """`json.dumps`'s `default`: a numpy scalar or a 0-d tensor as the Python number or bool
    it holds (an np.int64 was stored as the string '12'), anything else as its str()."""
    if getattr(o, "ndim", None) == 0 and callable(getattr(o, "item", None)):
        with contextlib.suppress(Exception):
            v = o.item()
            if isinstance(v, (bool, int, float)):
                return v
    return str(o)
