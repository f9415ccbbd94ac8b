"""Where the training batch's logits figures come from (`probes/logit_rows.py` computes
them): the logits a loop hands over (`start()`'s step_fn, `log(logits=...)`), else a
forward hook on the model's output layer (the Trainer, Lightning, a loop that hands none).
PaLM adds 1e-4 · log²Z to its loss, OLMo 2 1e-5: log Z is what a z-loss holds near 0.

The figures are 0-dim tensors on the logits' device, staged with the step's other device
figures: they cross to the host in the step's one copy, never a sync of their own. On a
CPU the rows are copied and reduced with the step's record instead (`probes/late.py`).

The probe pass's `logits/z_mean` and `logits/max_abs` (alerts/health.py) are the same figures
on two fixed probe samples once per eval; these are on the training batch every step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import late
from .activations import named_logits, output_layers, output_logits
from .logit_rows import (
    NAMES,
    POSITIONS,
    RowCopy,
    Rows,
    is_logits,
    log_z_and_top,
    logit_parts,
    reduce_rows,
    row_copy,
    row_figures,
)
from .paths import unwrapped


def reduce_copy(copied: RowCopy, mask: torch.Tensor | None = None,
                host: dict[str, Any] | None = None) -> list[torch.Tensor]:
    """The figures of copied rows: kept in `host` for the step's record (no parts), or
    computed now (where there is no `host`, or the mask is on a GPU)."""
    if host is not None and late.keep_rows(host, *copied, mask):
        return []
    x, sel, shape = copied
    lz, top = log_z_and_top(x)
    return reduce_rows((lz, top, sel, shape), mask)


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
        self.rows: Rows | RowCopy | None = None
        self.seen = False  # the last take found a training forward's figures
        self.armed = True
        self._thread = threading.get_ident()
        inner = getattr(model, "_orig_mod", None)
        found = output_layers(inner if isinstance(inner, nn.Module) else model)
        self.vocab: int | None = getattr(found[0][1], "out_features", None) if found else None
        if found and isinstance(inner, nn.Module):
            found = [("", model)]
        # no output layer (a Hugging Face classifier: ViTForImageClassification,
        # *ForSequenceClassification, Wav2Vec2ForCTC, whose get_output_embeddings() is
        # None): watched at the model's own output, where it names its logits
        # (`out.logits`, out["logits"]); a bare tensor there may be features, never taken,
        # nor a regression head's outputs (problem_type "regression", set by its first
        # forward with labels), which are no scores over classes
        self.named = not found
        if self.named:
            found = [("", model)]
        self.path = ", ".join(path for path, _ in found) or (
            f"of {type(model).__name__}'s own output" if self.named else None)
        # a model that softcaps its logits after the output layer (Gemma 2 and 3): the
        # hook's rows are capped as its loss sees them
        config = getattr(inner if isinstance(inner, nn.Module) else model, "config", None)
        self._config = getattr(unwrapped(inner if isinstance(inner, nn.Module) else model),
                               "config", None)  # a DDP-wrapped model's too
        cap = getattr(config, "final_logit_softcapping", None)
        self.cap = float(cap) if isinstance(cap, (int, float)) and cap > 0 else None
        self._handles = [mod.register_forward_hook(self._on_head) for _, mod in found]

    def _on_head(self, mod: nn.Module, args: Any, out: Any) -> None:
        if torch.compiler.is_compiling():
            return
        training = getattr(mod, "_orig_mod", mod).training
        if not (self.armed and training and torch.is_grad_enabled()
                and threading.get_ident() == self._thread):
            return
        with self._own:
            x = named_logits(out) if self.named else output_logits(out)
            if self.named and (x is None or getattr(self._config, "problem_type", None)
                               == "regression"):  # no logits named, or no classes: never
                self.remove()
                return
            if x is not None and is_logits(x) and self.vocab in (None, x.shape[-1]):
                self.rows = (row_copy(x, self.positions, self.cap)
                             or row_figures(x, self.positions, self.cap))
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

    def take(self, mask: torch.Tensor | None = None, rearm: bool = True,
             host: dict[str, Any] | None = None) -> tuple[list[str], list[torch.Tensor]]:
        """(names, parts) of the figures kept since armed (none if no training forward
        reached the output layer, or kept in `host` for the step's record: `seen` tells),
        padding left out where `mask` fits; `rearm`: keep the next training forward's too
        (on the calling thread)."""
        rows, self.rows = self.rows, None
        self.armed = rearm and self.watching
        self._thread = threading.get_ident()
        self.seen = rows is not None
        if rows is None:
            return [], []
        parts = reduce_copy(rows, mask, host) if len(rows) == 3 else reduce_rows(rows, mask)
        return (list(NAMES), parts) if parts else ([], [])

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
              rearm: bool = True, host: dict[str, Any] | None = None
              ) -> tuple[list[str], list[torch.Tensor]]:
        """(names, parts) of the step's logits figures: `logits`' when given, else the
        hook's (set now if it was not; `rearm`: see `HeadWatch.take`). With `host` (the
        step's host figures), CPU logits' rows are kept there for the step's record
        (`probes.late`) and no parts come back."""
        if logits is not None:
            self.close()  # handed over: the hook is not needed
            copied = row_copy(logits) if host is not None else None
            if copied is None:
                return list(NAMES), logit_parts(logits, mask)
            parts = reduce_copy(copied, mask, host)
            return (list(NAMES), parts) if parts else ([], [])
        if self.closed:  # it handed them before, or the run ended
            return [], []
        self.watch()
        if self.head is None:  # the model has no output layer
            return [], []
        got = self.head.take(mask, rearm, host)
        if not self.head.watching:  # the model's output named no logits: nothing to take
            self.close()
            return got
        # the first take may come before any forward could reach the hook (set just now);
        # a second in a row with nothing: no forward reaches it, say why once a run
        self._empty = 0 if self.head.seen else self._empty + 1
        if self._empty == 2 and self.say is not None:
            self.say("train_logits", UNSEEN.format(path=self.head.path, fix=self.fix))
        return got

    def rehook(self) -> None:
        """The model changed (a new output layer?): the hook is set again at the next take,
        on the output layer there is then."""
        head, self.head, self._empty = self.head, None, 0
        if head is not None:
            head.remove()

    def close(self) -> None:
        self.closed = True
        head, self.head = self.head, None
        if head is not None:
            head.remove()
