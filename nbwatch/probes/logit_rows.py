"""The output logits' per-row figures over a fixed subsample of positions: the mean
log-partition log Z (what a z-loss holds near 0) and the largest |logit|, from at most
`POSITIONS` rows taken by a fixed stride, so the cost does not grow with the batch or the
sequence length (only with the vocabulary: one logsumexp over `POSITIONS` × V values).
Pure functions on tensors; where the logits come from is `probes/logits.py`.
"""

from __future__ import annotations

from typing import Any

import torch

LOG_Z = "train_logits/log_z"
MAX_ABS = "train_logits/max_abs"
NAMES = [LOG_Z, MAX_ABS]
POSITIONS = 64  # positions a step looks at, at most
LARGE_V = 2048  # vocabularies from which `log_z_and_top` reads each row once fewer
ROW_BYTES = 1 << 19  # a CPU step's rows up to this size wait for its record (V ≤ 2048)


def subsample(logits: torch.Tensor, positions: int) -> tuple[torch.Tensor, slice]:
    """[N, V] logits of every position, and the fixed-stride slice of at most `positions`
    of them (the first, then every N // positions-th)."""
    x = logits.detach().reshape(-1, logits.shape[-1])
    stride = max(1, -(-x.shape[0] // positions))  # ceil: never more than `positions` rows
    return x, slice(None, None, stride)


def log_z_and_top(x: torch.Tensor, lean: bool | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a float [n, V]: log Σ exp (`torch.logsumexp`'s bits) and max |x|.
    `lean` (default: from `LARGE_V` on, and on any accelerator): the row's min and max read
    in one pass for both, |x| never written: 4 passes over the rows instead of 6 (150k:
    30-40% less time on a CPU, whose rows outgrow its cache) and 9 ops instead of 11 (a
    GPU's host launches each one). Below it a CPU's 3 extra small ops cost more than the
    pass."""
    if lean is None:
        lean = x.shape[-1] >= LARGE_V or x.device.type != "cpu"
    if not lean:
        return torch.logsumexp(x, dim=-1), x.abs().amax(dim=-1)
    lo, hi = torch.aminmax(x, dim=-1)
    # what torch.logsumexp subtracts and adds: 0 for an infinite max (a NaN max gives a
    # NaN row either way)
    m = torch.nan_to_num(hi, nan=0.0, posinf=0.0, neginf=0.0)
    return (x - m.unsqueeze(-1)).exp_().sum(-1).log_().add_(m), torch.maximum(hi, lo.neg())


def logit_parts(logits: torch.Tensor, mask: torch.Tensor | None = None,
                positions: int = POSITIONS) -> list[torch.Tensor]:
    """[log Z mean, max |logit|] over at most `positions` positions of `logits` [..., V], as
    0-dim float tensors on its device (no sync). `mask` ([...], 1 for a real token), when
    it fits the logits' positions (`aligned`: their shape, or a position shorter or longer
    beside labels shifted by hand), leaves padding out (by weight: no sync either).

    >>> names, parts = NAMES, logit_parts(out.logits, batch["attention_mask"])
    """
    return reduce_rows(row_figures(logits, positions), mask)


Rows = tuple[torch.Tensor, torch.Tensor, slice, tuple[int, ...]]
"""Per subsampled row: log Z, max |logit|; the rows taken; the logits' positions' shape."""
RowCopy = tuple[torch.Tensor, slice, tuple[int, ...]]
"""The subsampled rows (a float32 copy), the rows taken, the logits' positions' shape."""


def capped(rows: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The rows as a model that softcaps its logits computes its loss on them: cap ·
    tanh(x / cap) (Gemma 2 and 3's `final_logit_softcapping`, applied after the output
    layer, which a hook on that layer does not see); the rows only, never the batch."""
    return rows if not cap else torch.tanh(rows / cap).mul_(cap)


def row_copy(logits: torch.Tensor, positions: int = POSITIONS,
             cap: float | None = None) -> RowCopy | None:
    """A copy of the subsampled rows of CPU logits, to reduce with the step's record
    (`probes.late`: after a backward pass the ~15 small ops run cold, a batch of steps pays
    that once); None on a GPU (its ops are queued, not run) or for rows over `ROW_BYTES`."""
    if logits.device.type != "cpu":
        return None
    x, sel = subsample(logits, positions)
    if len(range(*sel.indices(x.shape[0]))) * x.shape[-1] * 4 > ROW_BYTES:
        return None
    return capped(x[sel].to(torch.float32, copy=True), cap), sel, tuple(logits.shape[:-1])


def row_figures(logits: torch.Tensor, positions: int = POSITIONS,
                cap: float | None = None) -> Rows:
    """The per-row half of `logit_parts`: what a forward hook takes while the logits are
    warm, before the step's mask is known (`cap`: the model's logit softcap)."""
    x, rows = subsample(logits, positions)
    lz, top = log_z_and_top(capped(x[rows].float(), cap))  # [n] each: n rows only
    return lz, top, rows, tuple(logits.shape[:-1])


def aligned(mask: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """`mask` over the logits' positions `shape`, as a loss that shifts its labels by hand
    weighs them (the logits at t predict token t + 1): as it is where it has their shape;
    a position shorter (the shifted labels' mask, of `logits[..., :-1, :]`) with the last
    position weighed 0; a position longer (the batch's attention_mask beside logits handed
    over as `logits[:, :-1]`) from its second on, `mask[..., 1:]`, as the loss's labels;
    None where it fits neither. No read: a slice, or one op on its device."""
    if mask is None:
        return None
    got = tuple(mask.shape)
    if got == shape:
        return mask
    if not shape or len(got) != len(shape) or got[:-1] != shape[:-1]:
        return None
    if got[-1] == shape[-1] - 1:
        m = mask.detach()
        return torch.cat([m, m.new_zeros((*got[:-1], 1))], dim=-1)
    return mask[..., 1:] if got[-1] == shape[-1] + 1 else None


def reduce_rows(figures: Rows, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The reducing half of `logit_parts`: the rows' mean log Z and max |logit|, padding
    left out by weight where `mask` fits the logits' positions (`aligned`)."""
    lz, top, rows, shape = figures
    mask = aligned(mask, shape)
    if mask is not None:
        m = mask.detach().reshape(-1)[rows]
        if m.device != lz.device:  # a CPU batch's mask, the batch moved inside the step_fn:
            # its rows go to the logits' device (no wait; a copy to the host must wait)
            m = m.to(lz.device, non_blocking=lz.device.type != "cpu")
        m = m.to(lz.dtype)
        n = m.sum()
        # no real token among the rows: NaN, a figure missing (not a false 0)
        return [(lz * m).sum() / n, torch.where(n > 0, (top * m).amax(), torch.nan)]
    return [lz.mean(), top.amax()]


def is_logits(x: Any) -> bool:
    """A float tensor [..., V] (V > 1) that can be logits (not a scalar loss)."""
    return (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] > 1
            and x.is_floating_point() and x.numel() > 0)
