"""A CPU step's batch figures taken with its record, not at the step: the masks' figures
(real tokens, sequence lengths, the padded count) and the logits' log Z and max |logit|.

Just after a backward pass every call runs cold: a numpy reduction that takes 20 µs warm
takes ~280, the logits' ~15 small torch ops ~230–410 µs against ~60 warm, and even a
look at a tensor's dtype ~45 (benchmarks/README.md). So the step only keeps copies of
what the figures need (its CPU masks, its logits' subsampled rows) in its host figures
under `KEY`, and the record of a batch of steps (recorder/step_end.py) computes them all
in one go, warm after the first: the same figures, bit for bit.

A mask of other values than 0 and 1 is refused at the run's first step, as before; found
later (at the record), its figures are left out and a warning says so once, as for a GPU
mask. What is not kept (a GPU tensor, a vocabulary whose rows outgrow
`logit_rows.ROW_BYTES`, a dtype numpy cannot read) is computed at the step; a bfloat16
mask is kept as a float32 copy (the same 0/1 values, the same sums).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .data import BAD, host_figures
from .logit_rows import LOG_Z, MAX_ABS, aligned, log_z_and_top

KEY = "_late"  # a step's host figures hold its `Late` under this key till its end
# the mask dtypes kept; numpy has no bfloat16: a bfloat16 mask's copy is float32
_KEPT = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                   torch.float16, torch.bfloat16, torch.float32, torch.float64})


@dataclass
class Late:
    """What one step keeps for its figures: copies of its CPU masks and of its logits'
    subsampled rows, with the mask that weights those rows."""

    masks: list[torch.Tensor] = field(default_factory=list)  # one per micro-batch
    rows: torch.Tensor | None = None  # [n, V] float32
    sel: slice | None = None  # which positions the rows are
    weight: torch.Tensor | None = None  # the rows' mask (None: every row counts)
    copies: dict[int, torch.Tensor] = field(default_factory=dict)  # id(mask) → its copy

    def copy(self, m: torch.Tensor) -> torch.Tensor:
        """One copy a step of a mask given twice (the masks' and the logits' weights)."""
        c = self.copies.get(id(m))
        if c is None:
            d = m.detach()
            c = self.copies[id(m)] = d.float() if d.dtype == torch.bfloat16 else d.clone()
        return c


def _of(host: dict[str, Any]) -> Late:
    late = host.get(KEY)
    if late is None:
        late = host[KEY] = Late()
    return late


def _keepable(m: torch.Tensor) -> bool:
    """A mask numpy can read on the host, or its copy can (else its figures are taken at
    the step)."""
    return (m.device.type == "cpu" and m.layout == torch.strided and m.dtype in _KEPT
            and m.numel() > 0 and m.dim() in (1, 2) and type(m) is torch.Tensor)


def keep_masks(host: dict[str, Any], masks: list[torch.Tensor]) -> bool:
    """Keep copies of the step's CPU masks for its record (True), or none (False: one
    cannot be read on the host; the caller takes their figures now). A mask of other
    values than 0 and 1 is found there: its figures are left out, said once."""
    if not masks or not all(_keepable(m) for m in masks):
        return False
    late = _of(host)
    late.masks = [late.copy(m) for m in masks]
    return True


def keep_mask(host: dict[str, Any], mask: torch.Tensor) -> bool:
    """`keep_masks` one micro-batch at a time: a copy of `mask` added to the step's kept
    masks (True), or nothing (False: the caller drops them with `drop_masks` and takes
    the step's figures now)."""
    if not _keepable(mask):
        return False
    late = _of(host)
    late.masks.append(late.copy(mask))
    return True


def drop_masks(host: dict[str, Any]) -> None:
    """Forget the masks kept so far this step (their figures are taken at the step)."""
    late = host.get(KEY)
    if late is not None:
        late.masks = []


def keep_rows(host: dict[str, Any], rows: torch.Tensor, sel: slice, shape: tuple[int, ...],
              mask: torch.Tensor | None) -> bool:
    """Keep a copy of the logits' subsampled rows (`logits.row_copy`) and of the mask
    that weights them (`mask`, where it fits the logits' positions' `shape`) for the
    step's record (True), or nothing (False: a mask on a GPU; the caller computes the
    figures now)."""
    fit = aligned(mask, shape)
    if fit is not None and fit.device.type != "cpu":
        return False
    late = _of(host)
    late.rows, late.sel = rows, sel
    # a mask aligned anew is a tensor of its own (its id may be another's once it is gone)
    late.weight = (None if fit is None else late.copy(fit) if fit is mask
                   else fit.detach().clone())
    return True


def resolve(steps: list[tuple[dict[str, Any], Late]]) -> list[torch.Tensor | None]:
    """Compute each step's figures (into its host figures) from what it kept: the logits'
    of steps with rows of one shape in one pass. Returns each step's masks' sequence
    lengths (None without masks, or for a mask of other values than 0 and 1, whose count
    goes in as `BAD`)."""
    by_shape: dict[tuple[tuple[int, ...], bool], list[tuple[dict[str, Any], Late]]] = {}
    for v, late in steps:
        if late.rows is not None:
            key = (tuple(late.rows.shape), late.weight is not None)
            by_shape.setdefault(key, []).append((v, late))
    for group in by_shape.values():
        _logit_figures(group)
    out: list[torch.Tensor | None] = []
    for v, late in steps:
        lengths = None
        if late.masks:
            figs = host_figures(late.masks)
            if figs is None:  # other values than 0 and 1: `bad_mask` says so at the record
                v[BAD] = float(sum(int(((m != 0) & (m != 1)).sum()) for m in late.masks))
            else:
                v.update(figs.host)
                v["_padded"] = figs.padded
                lengths = figs.lengths
        out.append(lengths)
    return out


def _logit_figures(group: list[tuple[dict[str, Any], Late]]) -> None:
    """log Z (the mean over the real rows) and max |logit| of each step of `group` (rows of
    one shape, all weighted or none), as `logits.reduce_rows` gives them, in one pass."""
    rows = torch.stack([late.rows for _, late in group if late.rows is not None])
    k, n, vocab = rows.shape
    lz, top = (t.view(k, n) for t in log_z_and_top(rows.view(k * n, vocab)))
    if group[0][1].weight is None:
        z, t = lz.mean(-1), top.amax(-1)
    else:
        m = torch.stack([late.weight.reshape(-1)[late.sel].to(lz.dtype)
                         for _, late in group if late.weight is not None])
        s = m.sum(-1)
        # no real token among the rows: NaN, a figure missing (not a false 0)
        z, t = (lz * m).sum(-1) / s, torch.where(s > 0, (top * m).amax(-1), torch.nan)
    for (v, _), (zi, ti) in zip(group, torch.stack([z, t], -1).tolist()):
        v[LOG_Z], v[MAX_ABS] = zi, ti
