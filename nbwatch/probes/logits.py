"""The output logits' health on every training step: the mean log-partition log Z (what a
z-loss holds near 0: PaLM adds 1e-4 · log²Z to its loss, OLMo 2 1e-5) and the largest
|logit|, over a fixed subsample of at most `POSITIONS` positions, so the cost does not grow
with the batch or the sequence length (only with the vocabulary: one logsumexp over
`POSITIONS` × V values).

The figures are 0-dim tensors on the logits' device, staged with the step's other device
figures: they cross to the host in the step's one copy, never a sync of their own.

The probe pass's `logits/z_mean` and `logits/max_abs` (health.py) are the same figures
on two fixed probe samples once per eval; these are on the training batch every step.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .activations import output_layers, output_logits

LOG_Z = "train_logits/log_z"
MAX_ABS = "train_logits/max_abs"
NAMES = [LOG_Z, MAX_ABS]
POSITIONS = 64  # positions a step looks at, at most
LARGE_V = 2048  # vocabularies from which `_log_z_and_top` reads each row once fewer


def _rows(logits: torch.Tensor, positions: int) -> tuple[torch.Tensor, slice]:
    """[N, V] logits of every position, and the fixed-stride slice of at most `positions`
    of them (the first, then every N // positions-th)."""
    x = logits.detach().reshape(-1, logits.shape[-1])
    stride = max(1, -(-x.shape[0] // positions))  # ceil: never more than `positions` rows
    return x, slice(None, None, stride)


def _log_z_and_top(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a float [n, V]: log Σ exp (`torch.logsumexp`'s bits) and max |x|. From
    `LARGE_V` on, the row max is read once for both and |x| is never written: 4 passes over
    the rows instead of 6 (150k: 30-40% less time on a CPU, whose rows outgrow its cache);
    below it the 3 extra small ops cost more than the pass."""
    if x.shape[-1] < LARGE_V:
        return torch.logsumexp(x, dim=-1), x.abs().amax(dim=-1)
    hi, lo = x.amax(dim=-1), x.amin(dim=-1)
    m = hi.masked_fill(hi.abs() == math.inf, 0)  # what torch.logsumexp subtracts and adds
    return (x - m.unsqueeze(-1)).exp_().sum(-1).log_().add_(m), torch.maximum(hi, lo.neg())


def logit_parts(logits: torch.Tensor, mask: torch.Tensor | None = None,
                positions: int = POSITIONS) -> list[torch.Tensor]:
    """[log Z mean, max |logit|] over at most `positions` positions of `logits` [..., V], as
    0-dim float tensors on its device (no sync). `mask` ([...], 1 for a real token), when
    its shape is the logits' positions, leaves padding out (by weight: no sync either).

    >>> names, parts = NAMES, logit_parts(out.logits, batch["attention_mask"])
    """
    return reduce_rows(row_figures(logits, positions), mask)


Rows = tuple[torch.Tensor, torch.Tensor, slice, tuple[int, ...]]
"""Per subsampled row: log Z, max |logit|; the rows taken; the logits' positions' shape."""


def row_figures(logits: torch.Tensor, positions: int = POSITIONS) -> Rows:
    """The per-row half of `logit_parts`: what a forward hook takes while the logits are
    warm, before the step's mask is known."""
    x, rows = _rows(logits, positions)
    lz, top = _log_z_and_top(x[rows].float())  # [n] each: n rows only
    return lz, top, rows, tuple(logits.shape[:-1])


def reduce_rows(figures: Rows, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The reducing half of `logit_parts`: the rows' mean log Z and max |logit|, padding
    left out by weight where `mask` has the logits' positions' shape."""
    lz, top, rows, shape = figures
    if mask is not None and tuple(mask.shape) == shape:
        m = mask.detach().reshape(-1)[rows].to(lz.dtype)
        n = m.sum()
        # no real token among the rows: NaN, a figure missing (not a false 0)
        return [(lz * m).sum() / n, torch.where(n > 0, (top * m).amax(), torch.nan)]
    return [lz.mean(), top.amax()]


def is_logits(x: Any) -> bool:
    """A float tensor [..., V] (V > 1) that can be logits (not a scalar loss)."""
    return (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] > 1
            and x.is_floating_point() and x.numel() > 0)


UNSEEN = (
    "train_logits/* (the training batch's log Z and max |logit|) are not recorded: no "
    "training forward reached the hook on the output layer {path}: a torch.compile'd graph "
    "that holds it runs without it, or the loss reads the layer's weight without calling "
    "it (a fused linear cross-entropy). {fix}")
FIX = {"loop": "Return {'logits': ...} from the step_fn (or log(logits=...)), or give the "
               "Monitor the compiled model.",
       "framework": "Under the Trainer or Lightning they cannot be taken then; every other "
                    "figure is recorded as usual."}


class HeadWatch:
    """A forward hook on a model's output layer (`get_output_embeddings()`, else each Linear
    onto the vocabulary) that keeps the per-row figures of a training forward while armed
    (from `arm()` or a `take()` that re-arms): the logits of a loop that hands nbwatch none
    (the Trainer, Lightning, a step_fn returning `out.loss`, an own loop's `log()`).
    `keep="first"`: the first such forward, then it disarms; "last": each one replaces the
    one before until `hold()` (the optimizer step) or the take.

    Only a forward in training mode with gradients on, on the thread that armed it, counts:
    an eval's, nbwatch's probe pass, another thread's forward are not the training batch.
    A `torch.compile`d model whose output layer is found is watched at its own output (its
    hooks run outside the compiled graph, whose output layer's would break it), on logits
    as wide as that layer's; a hook that Dynamo traces anyway (an output layer inside a
    model compiled elsewhere) does nothing, so it never splits the graph."""

    def __init__(self, model: nn.Module, positions: int = POSITIONS,
                 own: Any = None, keep: str = "first"):
        self.positions, self.keep = positions, keep
        self._own = own if own is not None else contextlib.nullcontext()  # time/nbwatch
        self.rows: Rows | None = None
        self.armed = True
        self._thread = threading.get_ident()
        inner = getattr(model, "_orig_mod", None)
        found = output_layers(inner if isinstance(inner, nn.Module) else model)
        self.vocab: int | None = getattr(found[0][1], "out_features", None) if found else None
        if found and isinstance(inner, nn.Module):
            found = [("", model)]
        self.path = ", ".join(path for path, _ in found) or None
        self._handles = [mod.register_forward_hook(self._on_head) for _, mod in found]

    def _on_head(self, mod: nn.Module, args: Any, out: Any) -> None:
        if torch.compiler.is_compiling():
            return
        training = getattr(mod, "_orig_mod", mod).training
        if not (self.armed and training and torch.is_grad_enabled()
                and threading.get_ident() == self._thread):
            return
        with self._own:
            x = output_logits(out)
            if x is not None and is_logits(x) and self.vocab in (None, x.shape[-1]):
                self.rows = row_figures(x, self.positions)
                self.armed = self.keep != "first"

    @property
    def watching(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """Keep the next training forward's figures (those kept so far are dropped)."""
        self.rows, self.armed = None, self.watching
        self._thread = threading.get_ident()

    def hold(self) -> None:
        """Keep what is kept: no later forward replaces it before the take."""
        self.armed = False

    def take(self, mask: torch.Tensor | None = None, rearm: bool = True
             ) -> tuple[list[str], list[torch.Tensor]]:
        """(names, parts) of the figures kept since armed (none if no training forward
        reached the output layer), padding left out where `mask` fits; `rearm`: keep the
        next training forward's too (on the calling thread)."""
        rows, self.rows = self.rows, None
        self.armed = rearm and self.watching
        self._thread = threading.get_ident()
        return (list(NAMES), reduce_rows(rows, mask)) if rows is not None else ([], [])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.rows, self.armed = None, False


class TrainLogits:
    """Where a loop's per-step logits figures come from: the logits its step hands over
    (`start()`'s step_fn, `log(logits=...)`), else a `HeadWatch` on the model's output
    layer, set at the first step that hands none (so a step_fn that returns logits never
    adds a hook to a model that may be compiled: a recompile) and removed for good once
    a step hands its logits, or the run ends (`close()`). `keep`: which training forward
    of a step counts ("first": `start()`, which arms each step; "last": an own loop, whose
    last forward before its optimizer step is the batch it trained on)."""

    def __init__(self, model: nn.Module, own: Any = None, keep: str = "last",
                 say: Callable[[str, str], None] | None = None):
        self.model, self.own, self.keep, self.say = model, own, keep, say
        self.fix = FIX["loop"]  # what the note on figures never taken tells the user
        self.head: HeadWatch | None = None
        self.closed = False  # a step handed its logits, or the run ended: no hook since
        self._empty = 0  # takes in a row that found nothing

    def watch(self) -> None:
        """Set the hook now (a framework's fit, which hands no logits: from step 1)."""
        if self.head is None and not self.closed:
            self.head = HeadWatch(self.model, own=self.own, keep=self.keep)
            if not self.head.watching:  # no output layer: nothing to take, ever
                self.close()

    def arm(self) -> None:
        """A step begins: the hook keeps its first training forward."""
        if self.head is not None:
            self.head.arm()

    def hold(self) -> None:
        """The optimizer step: the forward kept is the step's."""
        if self.head is not None:
            self.head.hold()

    def parts(self, logits: torch.Tensor | None, mask: torch.Tensor | None = None,
              rearm: bool = True) -> tuple[list[str], list[torch.Tensor]]:
        """(names, parts) of the step's logits figures: `logits`' when given, else the
        hook's (set now if it was not; `rearm`: see `HeadWatch.take`)."""
        if logits is not None:
            self.close()  # handed over: the hook is not needed
            return list(NAMES), logit_parts(logits, mask)
        if self.closed:  # it handed them before, or the run ended
            return [], []
        self.watch()
        if self.head is None:  # the model has no output layer
            return [], []
        got = self.head.take(mask, rearm)
        # the first take may come before any forward could reach the hook (set just now);
        # a second in a row with nothing: no forward reaches it, say why once a run
        self._empty = 0 if got[0] else self._empty + 1
        if self._empty == 2 and self.say is not None:
            self.say("train_logits", UNSEEN.format(path=self.head.path, fix=self.fix))
        return got

    def close(self) -> None:
        self.closed = True
        head, self.head = self.head, None
        if head is not None:
            head.remove()
