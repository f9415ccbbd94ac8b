"""The step boundary of a loop of your own: what `Monitor.log()` does once per optimizer
step (the step's record, the queued commands, a stop, what a rewind asks of the loop)."""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from ..probes.combined import Tally, loader_batches
from ..probes.data import (
    BESIDE,
    additive_01,
    all_real,
    decoder_mask,
    documents,
    input_tokens,
    is_encoder_decoder,
    packed_positions,
)
from ..recorder import Rewound, StopTraining
from ..records import Event
from .accumulation import one_of_many
from .exiting import raise_if_terminated
from .inputs import check_val, log_figures, mask_samples
from .session import RunSession


class Logged(NamedTuple):
    """What one `log()` returns to the loop: the step recorded (after a rewind, the
    checkpoint's step the weights are now at), the rewind, the batches to skip now."""

    step: int
    rewound: Rewound | None
    skip_batches: int


def log_step(session: RunSession, run_thread: threading.Thread | None, loss: Any,
             mask: torch.Tensor | list[torch.Tensor] | None, val: Any, batch: Any,
             logits: torch.Tensor | None, scalars: dict[str, Any],
             end_loop: Callable[[BaseException | None], None]) -> Logged:
    """Record the step just taken and apply the commands queued for its boundary (pause
    blocks here); a stop ends the run, closes a foreground loop (`end_loop`) and raises
    `StopTraining`."""
    rec = session.recorder_for_log(run_thread)
    count = session.watch.backwards
    micro = count.take() if count is not None else 0  # the step's backward passes
    with rec.own:
        said = one_of_many(loss, max(micro, len(mask) if isinstance(mask, (list, tuple)) else 1))
        batches = _batches(batch, micro, session.setup.model)
        rec.note_logged_batch(batches[0], scalars)  # takes epoch=/index= given with a batch
        for b in batches[1:]:
            rec.batch_ids.note_batch(b)  # the step's other micro-batches, as start()'s
        # a batch in parts (`loader_batches`): each one's tokens, the batch's own samples
        splits = [loader_batches(b, _enc_dec(session.setup.model)) for b in batches]
        mask_given, steps = mask, batches
        batches = [p for s in splits for p in s.parts]
        positions, rows, mask, logit_mask, bare = _masks(batches, mask, session.setup.model)
        tally = Tally()
        for s, b in zip(splits, steps):
            tally.add(b, s, [p for p in bare if any(p is q for q in s.parts)])
        host, names, parts, lengths = log_figures(loss, mask, scalars,
                                                  first=rec.step == session.progress_start,
                                                  logits=logits, source=rec.train_logits,
                                                  keep=not positions, logit_mask=logit_mask)
        if positions:  # a packed batch: its documents' figures, as start()'s
            if mask is None:  # every token real: known from the shapes
                all_real(positions).into(names, parts, host)
            lengths = documents(positions, names, parts, rows)
            if mask_given is None:  # micro-batches of no tokens beside: samples too
                host[BESIDE] = float(tally.beside)
        val = check_val(val)
        host.update(rec.forward_time())  # under torchrun: what tells a straggler
    # the mask given's rows, else the micro-batches' (`Tally`: as start()'s, the Trainer's,
    # Lightning's; speech features, pixels, an (x, y) batch: their first batched tensor's)
    samples = ((mask_samples(mask) if mask_given is not None else None)
               or (None if positions else tally.samples))
    step = rec.record_step(host, names, parts, lengths=lengths, samples=samples, val=val,
                           reduction="as computed by the training loop (mon.log)")
    if said is not None and "accumulation" not in rec.evals.probe_said:  # once a run
        rec.evals.probe_said.add("accumulation")
        if rec.dist is None or rec.dist.rank == 0:  # the job's console says it once
            warnings.warn(said, stacklevel=3)
        rec.record_event(Event(step, "probe", "warning", said, {"loss": "one micro-batch's"}))
    if rec.boundary():
        rec.finish("stopped")
        if session.mode == "loop":
            end_loop(None)  # closed now, not at exit: a new run can start
        raise StopTraining(f"run {session.setup.name!r} stopped at step {step}, final "
                           "checkpoint written (mon.run() and `with mon:` end the loop "
                           "cleanly)")
    raise_if_terminated(session)  # its step recorded first
    # what a rewind or a skip asks of the loop: said once, at this log(), never merged into
    # a later one
    rw = rec.rewind_state
    skip, rw.skip_batches = rw.skip_batches, 0
    if rw.rewound_to is None:
        return Logged(step, None, skip)
    rewound, rw.rewound_to = Rewound(rw.rewound_to, skip), None
    return Logged(rewound.step, rewound, skip)


def _batches(batch: Any, backwards: int, model: Any) -> list:
    """`log(batch=...)` as the step's micro-batches: a list of dict batches is one each.
    Not an encoder-decoder's where the step took another number of backward passes
    (counted: `backwards` > 0): one batch in parts, its source's and its target's
    tokenizer outputs (`(src, tgt)`), which names neither: no data figures, rather than
    the target's tokens and rows counted as a second micro-batch's. A list of `(x, y)`
    batches is one each where the step took that many backward passes (else it is one
    batch of nested parts: two views of a contrastive pair)."""
    if isinstance(batch, (list, tuple)) and batch and all(isinstance(b, Mapping) for b in batch):
        if len(batch) > 1 and backwards and backwards != len(batch) and _enc_dec(model):
            return [batch]
        return list(batch)
    if (isinstance(batch, (list, tuple)) and len(batch) > 1 and backwards == len(batch)
            and all(isinstance(b, (list, tuple)) for b in batch)):
        return list(batch)
    return [batch]


_ENC_DEC: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _masks(batches: list, mask: Any, model: Any
           ) -> tuple[list[torch.Tensor], list[torch.Tensor], Any, Any, list]:
    """The step's packed positions, the masks of its micro-batches not packed (each row a
    sample beside the documents), its masks, its logits' mask (`log_figures`) and its
    batches of no tokens beside those of tokens (a loader's `(x, y)` or pixels beside one
    of text: their rows are samples too). With no `mask=`, the batches' own tokens, as the
    Trainer counts them (`input_tokens`: the attention_mask, else every input_ids token; an
    encoder-decoder's source, its logits weighed by the target's mask, `decoder_mask`);
    none where no batch holds either, or a mask is not the [batch, seq_len] one
    `log_figures` takes. A float additive mask
    given (0.0 real, negative padding) is taken as the 0/1 one it stands for; an
    encoder-decoder's given without a batch is its source's: its logits over every
    position."""
    if isinstance(mask, (list, tuple)):
        mask = [additive_01(m) if isinstance(m, torch.Tensor) else m for m in mask]
    elif isinstance(mask, torch.Tensor):
        mask = additive_01(mask)
    if batches[0] is None:  # an encoder-decoder's mask given alone is its source's (the
        # rule): its logits, the target's, are over every position
        return [], [], mask, None if mask is not None and _enc_dec(model) else ..., []
    found = [packed_positions(b) for b in batches]
    # an encoder-decoder's logits are the target's, whatever mask the data figures count
    logit_mask = decoder_mask(batches[-1]) if _enc_dec(model) else ...
    positions = [p for p in found if p is not None]
    if mask is None and len(positions) == len(batches):
        return positions, [], None, logit_mask, []  # every token real (`all_real`)
    bare: list = []
    if mask is None:
        masks = [input_tokens(b) for b in batches]
        if all(m is None for m in masks) or any(m is not None and m.dim() > 2 for m in masks):
            return [], [], None, logit_mask, []  # (a multiple-choice [B, C, T])
        bare = [b for b, m in zip(batches, masks) if m is None]
        found = [p for p, m in zip(found, masks) if m is not None]
        positions = [p for p in found if p is not None]
        masks = [m for m in masks if m is not None]
        mask = masks[0] if len(masks) == 1 else masks
    given = list(mask) if isinstance(mask, (list, tuple)) else [mask]
    if len(given) != len(found) or not positions:
        return [], [], mask, logit_mask, bare  # not one mask a batch: rows are the samples
    return positions, [m for m, p in zip(given, found) if p is None], mask, logit_mask, bare


def _enc_dec(model: Any) -> bool:
    """`is_encoder_decoder(model)`, asked once a model."""
    try:
        return _ENC_DEC[model]
    except (KeyError, TypeError):
        enc_dec = is_encoder_decoder(model)
        with contextlib.suppress(TypeError):
            _ENC_DEC[model] = enc_dec
        return enc_dec
