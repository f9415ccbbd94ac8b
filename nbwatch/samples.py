"""What `sample_fn` may return at an eval, made storable: text (as it is), an image (a
uint8 or [0, 1] float array or tensor, [H, W], [H, W, C] or [C, H, W] with C 1, 3 or 4, or
a PIL image), or a small table (a DataFrame, or a list of dicts). Images are stored as PNG,
encoded here (no imaging library needed); tables as their first rows and columns."""

from __future__ import annotations

import base64
import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MAX_SIDE = 256  # larger images are subsampled to this: the page keeps the last 50
MAX_ROWS, MAX_COLS, MAX_CELL = 50, 20, 200  # a table's shown part


MAX_SAMPLE_TEXT = 64 * 1024  # characters of a text sample kept: the page and export show them


def capped_text(text: str) -> str:
    """`text`, cut to MAX_SAMPLE_TEXT characters with a note of how many were left out."""
    if len(text) <= MAX_SAMPLE_TEXT:
        return text
    return text[:MAX_SAMPLE_TEXT] + f"… [truncated {len(text) - MAX_SAMPLE_TEXT} chars]"


def sample_content(x: Any) -> tuple[str, dict[str, Any] | None]:
    """(text, content) for a `Sample`: the text of a string (content None); for an image
    or a table a one-line summary and what the samples panel draws. Anything else is
    recorded as its `str()`, as before."""
    if isinstance(x, str):
        return x, None
    if _is_pil(x):
        x = np.asarray(x.convert("RGBA" if "A" in x.getbands() else "RGB"))
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return _image(x)
    if hasattr(x, "to_dict") and hasattr(x, "columns"):  # a pandas DataFrame
        return _table([str(c) for c in x.columns], x.head(MAX_ROWS).values.tolist(), len(x))
    if isinstance(x, Sequence) and x and all(isinstance(r, Mapping) for r in x):
        named = [{str(k): v for k, v in r.items()} for r in x[:MAX_ROWS]]
        cols = list(dict.fromkeys(k for r in named for k in r))
        return _table(cols, [[r.get(c) for c in cols] for r in named], len(x))
    return capped_text(str(x)), None


def _is_pil(x: Any) -> bool:
    return type(x).__module__.startswith("PIL.") and hasattr(x, "getbands")


def _image(a: np.ndarray) -> tuple[str, dict[str, Any]]:
    what = f"sample_fn returned an array of shape {a.shape} and dtype {a.dtype}"
    if a.ndim == 3 and a.shape[0] in (1, 3, 4) and a.shape[-1] not in (1, 3, 4):
        a = np.moveaxis(a, 0, -1)  # [C, H, W] → [H, W, C]
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[-1] not in (3, 4)) or 0 in a.shape:
        raise ValueError(f"{what}: an image is [H, W], [H, W, C] or [C, H, W] with C = 1, 3 "
                         "or 4 (return a string for text, or a DataFrame for a table)")
    if a.dtype == np.bool_:
        a = a.astype(np.uint8) * 255
    elif a.dtype.kind == "f":
        if not np.isfinite(a).all():
            raise ValueError(f"{what} holding NaN or inf: an image's values must be finite")
        lo, hi = float(a.min()), float(a.max())
        if lo < 0 or hi > 1:
            raise ValueError(f"{what} with values in [{lo:.3g}, {hi:.3g}]: a float image is "
                             "in [0, 1] (or pass uint8 0–255)")
        a = np.rint(a * 255).astype(np.uint8)
    elif a.dtype != np.uint8:
        if a.dtype.kind not in "iu" or a.min() < 0 or a.max() > 255:
            raise ValueError(f"{what}: an image is uint8 (0–255) or float in [0, 1]")
        a = a.astype(np.uint8)
    h, w = a.shape[:2]
    step = max(1, math.ceil(max(h, w) / MAX_SIDE))
    a = np.ascontiguousarray(a[::step, ::step])
    png = encode_png(a)
    return (f"image {w}×{h}" + (f" (shown at {a.shape[1]}×{a.shape[0]})" if step > 1 else ""),
            {"kind": "image", "width": int(a.shape[1]), "height": int(a.shape[0]),
             "png": base64.b64encode(png).decode("ascii")})


def _table(cols: list[str], rows: list[list[Any]], n: int) -> tuple[str, dict[str, Any]]:
    n_cols = len(cols)
    cols, rows = cols[:MAX_COLS], [r[:MAX_COLS] for r in rows]
    cells = [[_cell(v) for v in r] for r in rows]
    shown = [f"first {len(rows)} rows" if n > len(rows) else "",
             f"first {len(cols)} columns" if n_cols > len(cols) else ""]
    part = " and ".join(x for x in shown if x)
    return (f"table {n} × {n_cols}" + (f" ({part})" if part else ""),
            {"kind": "table", "columns": cols, "rows": cells, "n_rows": n, "n_cols": n_cols})


def _cell(v: Any) -> str | float | None:
    if v is None or isinstance(v, bool):
        return None if v is None else str(v)
    if isinstance(v, (int, float, np.integer, np.floating)):
        f = float(v)
        return f if math.isfinite(f) else str(f)
    return str(v)[:MAX_CELL]


def encode_png(a: np.ndarray) -> bytes:
    """A PNG of a uint8 [H, W] (grey), [H, W, 3] (RGB) or [H, W, 4] (RGBA) array."""
    h, w = a.shape[:2]
    colour = 0 if a.ndim == 2 else {3: 2, 4: 6}[a.shape[2]]  # grey, RGB, RGBA
    raw = np.concatenate([np.zeros((h, 1), np.uint8), a.reshape(h, -1)], axis=1)  # filter 0

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, colour, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + chunk(b"IEND", b""))
