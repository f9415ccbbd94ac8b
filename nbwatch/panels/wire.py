"""The wire format shared by the widget's messages and the HTML export: a JSON-able tree
whose numpy arrays travel as binary buffers (`js/plot.js` `unpack()` reverses it)."""

from __future__ import annotations

from typing import Any

import numpy as np

_DTYPES = {np.dtype(np.float32): "f4", np.dtype(np.int32): "i4", np.dtype(np.uint8): "u1"}


def pack(obj: Any, buffers: list[memoryview]) -> Any:
    """Replace numpy arrays in a JSON-able tree by `{"$buf": i, "dtype", "shape"}`, their bytes
    appended to `buffers` (float64/int64 are narrowed to float32/int32)."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "f":
            obj = obj.astype(np.float32, copy=False)
        elif obj.dtype.kind in "iu" and obj.dtype != np.uint8:
            obj = obj.astype(np.int32, copy=False)
        buffers.append(np.ascontiguousarray(obj).data.cast("B"))  # .data: memoryview(a)
        return {"$buf": len(buffers) - 1, "dtype": _DTYPES[obj.dtype], "shape": list(obj.shape)}
    if isinstance(obj, dict):
        return {str(k): pack(v, buffers) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [pack(v, buffers) for v in obj]
    if isinstance(obj, (np.floating, float)):
        f = float(obj)
        return f if np.isfinite(f) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj
