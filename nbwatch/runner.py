"""The loop `Monitor.start()` runs: a thin loop over the shared `StepRecorder`.

    commands (between steps) → fetch batch (timed: data wait) → step_fn → backward
    (× accumulate) → stage the loss → optimizer step (the recorder's hooks measure,
    skip or clip it) → scheduler step → zero_grad → end of step → [eval, checkpoint]
"""

from __future__ import annotations

import contextvars
import io
import numbers
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import controls as ctl
from .checkpoint import rng_state, set_rng_state
from .epoch_order import open_pass
from .evaluation import evaluate
from .probes.attention import clone_samples
from .probes.combined import Tally, loader_batches
from .probes.data import (
    BESIDE,
    ZEROS,
    all_real,
    batch_figures,
    check_mask,
    decoder_mask,
    documents,
    input_tokens,
    is_encoder_decoder,
    packed_positions,
    reads_tokens,
)
from .probes.late import drop_masks, keep_mask
from .probes.logits import NAMES as LOGIT_NAMES
from .probes.logits import is_logits
from .probes.loss import batch_mask, check_not_copying, input_mask, parse_step_output
from .recorder import Progress, RunSpec, StepRecorder
from .records import Event

__all__ = ["Progress", "RunSpec", "Runner", "run_in_thread"]

SKIP_BITE = 64  # batches skipped between two looks at the commands


class Runner:
    """Runs `spec.step_fn` over `spec.train_data` for `spec.max_steps` optimizer steps."""

    def __init__(self, spec: RunSpec, recorder: StepRecorder):
        self.spec, self.rec = spec, recorder
        rw = recorder.rewind_state
        rw.runs_loop = rw.can_rewind = True  # the data and the steps are ours
        self._data: Iterator | None = None
        self._epoch = 0
        self._batches = 0  # taken from train_data so far
        self._index = 0  # the next batch's position in its epoch
        self._pos = (0, 0)  # (epoch, index) of the batch taken last
        self._checked = False
        self._enc_dec = is_encoder_decoder(recorder.model)  # T5, BART: see _forward_backward
        self._pending: Any = None  # a batch taken early (the dry run's probe samples)
        self._order: dict[str, Any] | None = None  # a resumed pass's (epoch_order.py)
        if rw.data_at is not None:  # resumed: on from where the checkpoint's run stood
            self._epoch, skip = rw.data_at
            rw.skip_batches += skip
            self._order = rw.data_order
            how = ("its order drawn again under the RNG states it was first drawn with: the "
                   "batches trained on before" if self._order is not None
                   and self._order.get("known", True) else
                   "its order drawn again under the RNG states it was first drawn with, but "
                   "an order drawn elsewhere (an iterable dataset's own shuffle) may differ"
                   if self._order is not None else
                   "its order drawn anew (the checkpoint keeps none): if it is shuffled, "
                   "not the batches trained on before")
            recorder._emit(Event(recorder.step, "state", "info",
                                 f"resumed at epoch {self._epoch}, batch {skip} of the data: "
                                 f"its first {skip} batches are skipped ({how})",
                                 {"epoch": self._epoch, "skip": skip,
                                  "order": self._order is not None
                                  and self._order.get("known", True)}))

    def run(self) -> None:
        self.rec.guarded(self._loop)

    def _loop(self) -> None:
        spec, rec = self.spec, self.rec
        if spec.dry_run and not spec.trial:
            self._dry_run()
        assert spec.max_steps is not None, "start() gives the runner its step count"
        every = spec.eval_every or 0
        rec.train_logits.keep = "first"  # the first micro-batch's, as for logits handed over
        due = False
        while rec.step < spec.max_steps:
            rec.apply_commands()
            if rec.stopping:
                return
            if rec.rewind_state.skip_batches:  # a skip or a rewind's, a bite at a time:
                self._skip(SKIP_BITE)  # stop and pause are heard between bites
                continue
            self._train_step()
            # the last step's eval is its checkpoint's too (not a second one after it)
            due = bool(every) and rec.step % every == 0 or (
                spec.val_fn is not None and rec.step >= spec.max_steps)
            rec.step_done(eval_due=due)
        if spec.val_fn is not None and not due:
            rec.evaluate()

    def _dry_run(self) -> None:
        """Before step 1, what would otherwise fail only at the first eval or checkpoint:
        `val_fn`, the attention probe on its batch, `sample_fn`, and a checkpoint's state
        (all but the tensors, serialised to memory). Nothing is recorded, and the RNG (and
        a ReduceLROnPlateau that val_fn steps, with the LRs) is restored after, so
        training goes exactly as without it."""
        spec, rec = self.spec, self.rec
        plateau = rec.sched.state_dict() if ctl.on_metric(rec.sched) else None
        lrs = [g["lr"] for g in rec.opt.param_groups]
        if spec.eval_every and spec.probe_batch is None and spec.attention_samples > 0:
            self._pending = self._take()  # step 1's batch: the default probe samples
            spec.probe_batch = clone_samples(self._pending, spec.attention_samples)
        saved = rng_state()
        try:
            what = "a checkpoint"
            state = rec.state_dict()
            torch.save({k: v for k, v in state.items() if k not in ("model", "optimizer")},
                       io.BytesIO())
            if spec.eval_every or spec.val_fn is not None:
                what = "the first eval (val_fn, the attention probe or sample_fn)"
                result = evaluate(rec.model, spec, rec.step, None)
                if result.probe_error is not None:
                    rec.probe_failed(result.probe_error, result.probe_severity)
        except Exception as e:
            raise RuntimeError(
                f"{what} failed in the dry run before step 1, so the run stopped there "
                f"rather than at step {spec.eval_every or spec.checkpoint_every}: "
                f"{type(e).__name__}: {e} (start(..., dry_run=False) skips this check)"
            ) from e
        finally:
            set_rng_state(saved)
            if plateau is not None:
                rec.sched.load_state_dict(plateau)
                for g, lr in zip(rec.opt.param_groups, lrs):
                    g["lr"] = lr

    def _skip(self, most: int) -> None:
        """Throw away up to `most` of the batches a skip asked for: never trained on."""
        rw = self.rec.rewind_state
        for _ in range(min(most, rw.skip_batches)):
            rw.skip_batches -= 1
            self._take()
        rw.data_at = (self._epoch, self._index)

    def _take(self) -> Any:
        if self._pending is not None:
            batch, self._pending = self._pending, None
            return batch
        train_data = self.spec.train_data
        assert train_data is not None  # start() and preflight always give it (check_start)
        if self._data is None:
            self._data = self._open(train_data)
        try:
            batch = next(self._data)
        except StopIteration:
            self._epoch, self._index = self._epoch + 1, 0
            self._data = self._open(train_data)
            try:
                batch = next(self._data)
            except StopIteration:
                if self._batches:
                    raise ValueError(
                        f"train_data ran out after {self._batches} batches, before max_steps="
                        f"{self.spec.max_steps}: it cannot be iterated again (a generator or "
                        "iterator is used up after one pass); pass a list, a DataLoader, or "
                        "an iterable that can be iterated again") from None
                raise ValueError(
                    "train_data yielded no batches; pass a non-empty DataLoader or iterable"
                ) from None
        self._batches += 1
        self._pos = (self._epoch, self._index)  # a batch taken early keeps it till used
        self._index += 1
        return batch

    def _open(self, train_data: Iterable) -> Iterator:
        """A pass over the data from its start; the RNG states it was opened with are kept
        for the checkpoints, and a resumed pass is opened under its checkpoint's."""
        order, self._order = self._order, None
        it, self.rec.rewind_state.data_order = open_pass(train_data, order)
        return it

    def _train_step(self) -> None:
        """One optimizer step, in its stages: forward/backward over the micro-batches,
        measure (stage the device figures), optimizer step, record."""
        t0 = time.perf_counter()
        micro = self._forward_backward()
        with self.rec.own:
            figures = self._measure(micro)
        t_fb = time.perf_counter()
        self._optimizer_step()
        figures.update({"time/forward_backward": t_fb - t0 - micro.data_s,
                        "time/forward": micro.fwd_s})  # under DDP, before grad sync
        # from step 1 (0: the first pass), not only once the data has wrapped round
        figures["epoch"] = float(self._epoch)
        self.rec.rewind_state.data_at = (self._epoch, self._index)
        self.rec.end_step(figures, data_s=micro.data_s, samples=micro.tally.samples)

    def _forward_backward(self) -> _Micro:
        """`step_fn` and backward on `accumulate` batches; the gradients add up."""
        spec, rec = self.spec, self.rec
        model, scaler = rec.model, rec.scaler
        step_fn = spec.step_fn
        assert step_fn is not None  # start() and preflight always give it (check_start)
        # the run's first step reads its masks after the backward (a bad one is refused
        # then, the step's graph freed); later ones are copied and read with the record
        m = _Micro(keeping=rec.step != rec.start_step)
        first = not m.keeping
        rec.train_logits.arm()
        for i in range(spec.accumulate):
            td = time.perf_counter()
            batch = self._take()
            m.data_s += time.perf_counter() - td
            rec.note_batch(batch, *self._pos)
            split = loader_batches(batch, self._enc_dec)  # in parts: each one's tokens
            parts = split.parts
            rows = split.rows(batch)  # before step_fn, which may take from it (batch.pop)
            found = [packed_positions(p) for p in parts]
            if any(pos is not None for pos in found):  # masks read now: the histogram
                m.positions += [pos for pos in found if pos is not None]  # takes documents'
                m.keeping = False
            if spec.probe_batch is None and spec.eval_every and spec.attention_samples > 0:
                spec.probe_batch = clone_samples(batch, spec.attention_samples)
            tf, own0, wait0 = time.perf_counter(), rec.own.closed, rec.forward_waits()
            raw = step_fn(model, batch)
            if not self._checked:  # a wrong objective is refused at the first step
                check_not_copying(batch, raw, model)
                self._checked = True
            out = parse_step_output(raw)
            given = raw.get("mask") if isinstance(raw, dict) else None
            if isinstance(given, torch.Tensor) and given.is_floating_point() and given.numel():
                with rec.own:  # zeros alone: nothing to train on (said: `zeros_mask`), no read
                    m.zeros.append((given.detach() == 0).all())
            # an encoder-decoder's own mask (its target's) is not counted, nor that of a batch
            # of speech features or pixels (`reads_tokens`: no tokens), so not checked
            # there: looked at after the backward (a bad one freed with its graph), on the
            # first step, where the CPU reads it at no cost
            sourced = self._enc_dec or not reads_tokens(batch)
            target = out.mask if sourced and first else None
            if out.mask is None:  # {'logits', 'labels'}: the batch's attention_mask; an
                # encoder-decoder's logits are the target's: its target mask (the adapters')
                out.mask = decoder_mask(batch) if self._enc_dec else batch_mask(batch, raw)
            # less the output layer's hook (nbwatch's, inside the forward) and, under
            # torchrun, the wait for the other ranks as the forward began (DDP's buffers)
            m.fwd_s += (time.perf_counter() - tf - (rec.own.closed - own0)
                        - (rec.forward_waits() - wait0))
            if isinstance(raw, dict):
                with rec.own:  # the step_fn's own scalars, kept for the record
                    _extras(raw, m.extras)
            if i == 0:  # the first micro-batch's: a cost that does not grow with them; a
                # bare loss's (the output layer's logits) weighed by the batch's
                # attention_mask, as the Trainer's and log(batch=)'s are
                self._logit_figures(m, raw, out.mask if out.mask is not None or self._enc_dec
                                    else input_mask(batch))
            # each part's tokens read (`_tokens`); where none has any of its own ((x, y)
            # parts of token ids), the step's mask, as a batch in one part's
            counted = [(self._tokens(p, out.mask if len(parts) == 1 else None, pos), pos)
                       for p, pos in zip(parts, found)]
            m.tally.add(batch, split, [p for p, (t, pos) in zip(parts, counted)
                                       if t is None and pos is None], rows)  # every loop's
            if len(parts) > 1 and not any(t is not None or pos is not None for t, pos in
                                          counted) and all(reads_tokens(p) for p in parts):
                counted = [(out.mask, None)]
            for tokens, pos in counted:
                if tokens is None and pos is not None:  # packed, no mask: every token real
                    m.unmasked.append(pos)
                elif tokens is not None and m.keeping:
                    with rec.own:  # beside the rows' copy, still warm (its look at the mask)
                        m.keeping = keep_mask(m.host, tokens)
            m.reduction = out.reduction
            loss = out.loss / spec.accumulate if spec.accumulate > 1 else out.loss
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if target is not None and (target.device.type == "cpu" or target.is_complex()):
                with rec.own:
                    check_mask(target, "step_fn's mask", "its loss and log Z would be misweighted",
                               _TARGET_HOW)
            with rec.own:  # the loss kept for the record: watching's
                detached = out.loss.detach().float()
                m.loss_sum = detached if m.loss_sum is None else m.loss_sum + detached
            for tokens, pos in counted:
                if tokens is not None:
                    m.masks.append(tokens)
                    if pos is None:  # a padded batch: its rows are samples beside documents
                        m.rows.append(tokens)
        return m

    def _tokens(self, batch: Any, step_mask: torch.Tensor | None, packed: Any
                ) -> torch.Tensor | None:
        """The tokens read, not only those the loss weighs (a prompt's, a shifted row's); an
        encoder-decoder's are its source's, as the adapters', never the step's mask (its
        target's): attention_mask, else every input_ids token; a batch of speech features
        or pixels none (its attention_mask counts frames); else the batch's 2-D
        attention_mask, the step's mask, every input_ids token (as the Trainer) unless
        `packed` (its positions: every token real, from its shape)."""
        if self._enc_dec or not reads_tokens(batch):
            return input_tokens(batch)
        read = input_mask(batch)
        read = read if read is not None else step_mask
        return read if read is not None or packed is not None else input_tokens(batch)

    def _logit_figures(self, m: _Micro, raw: Any, mask: torch.Tensor | None) -> None:
        """The first micro-batch's logits' log Z and max |logit|, between the forward and
        the backward (the logits are warm; after the backward the rows are evicted): the
        step_fn's `logits`, else the output layer's (its forward hook's per-row figures);
        a fixed subsample, so a cost that does not grow with the batch; device figures,
        copied with the step's others; nbwatch's own time. The masks' figures wait for
        `_measure`: a bad mask fails the step after its backward, which frees its graph
        (an error raised before it would hold the activations through its traceback)."""
        logits = raw.get("logits") if isinstance(raw, dict) else None
        if (isinstance(logits, torch.Tensor) and not is_logits(logits)
                and not self.rec.train_logits.closed):
            # one output (a regression head), or not logits at all: said once, and no hook
            # on an output layer that would blame torch.compile for what it cannot see
            self.rec.train_logits.close()
            self.rec.probe_note("train_logits", (
                f"train_logits/* are not recorded: the step_fn's 'logits' are a tensor of "
                f"shape {tuple(logits.shape)} ({logits.dtype}), not [..., vocab] scores over "
                "two or more classes (log Z of a single output is that output)"))
        with self.rec.own:
            _, parts = self.rec.train_logits.parts(logits if is_logits(logits) else None,
                                                   mask, rearm=False, host=m.host)
        m.logits = parts or None

    def _measure(self, m: _Micro) -> dict[str, float]:
        """Stage the step's device figures (mean loss, the step_fn's tensor scalars, the
        logits' log Z and max |logit|, the masks' token counts) to be copied with the
        gradient norms: one sync. Returns the host figures (the padded token count among
        them)."""
        rec, accumulate = self.rec, self.spec.accumulate
        rec.save_reduction(m.reduction)
        loss_sum = m.loss_sum
        assert loss_sum is not None  # set by each of the accumulate (≥ 1) micro-batches
        mean = loss_sum / accumulate if accumulate > 1 else loss_sum
        names, parts = ["loss/train"], [mean]
        figures = m.host
        if m.tally.beside:  # samples beside a packed one's documents (`BESIDE`)
            figures[BESIDE] = m.tally.beside
        for k, vs in m.extras.items():  # the step_fn's own scalars, mean over micro-batches
            t = next((v for v in vs if isinstance(v, torch.Tensor)), None)
            if t is not None:  # on the device, copied with the step's other figures
                vs = [v if isinstance(v, torch.Tensor) else torch.tensor(v, device=t.device)
                      for v in vs]
                names.append(f"train/{k}")
                parts.append(torch.stack(vs).mean() if len(vs) > 1 else vs[0])
            else:
                figures[f"train/{k}"] = sum(vs) / len(vs)
        if m.logits is not None:
            names += LOGIT_NAMES
            parts += m.logits
        # packed: its documents' count, longest and lengths, for the record
        docs = documents(m.positions, names, parts, m.rows) if m.positions else None
        if docs is not None and m.unmasked and not m.masks:  # packed, every token real:
            all_real(m.unmasked).into(names, parts, figures)  # known from the shapes
            rec.keep_seq_lens(docs)
        elif m.masks and not m.keeping:  # the first step's, or one that cannot be kept
            drop_masks(figures)
            masks = m.masks + [torch.ones_like(p) for p in m.unmasked]
            lengths = batch_figures(masks).into(names, parts, figures)
            rec.keep_seq_lens(docs if docs is not None else lengths)
        if m.zeros:  # the float masks of zeros alone, counted on the device
            names.append(ZEROS)
            parts.append(torch.stack(m.zeros).sum().float())
        rec.stage(names, parts)  # copied to the host with the gradient norms: one sync
        return figures

    def _optimizer_step(self) -> None:
        """The optimizer step (the recorder's hooks measure, skip or clip it), then the
        scheduler's and zero_grad."""
        rec = self.rec
        opt, scaler = rec.opt, rec.scaler
        if scaler is not None:
            scaler.unscale_(opt)  # the hooks see the true gradients, even a fused optimizer's
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if rec.sched is not None and rec.stepped and not ctl.on_metric(rec.sched):
            # not after a GradScaler's overflow (no optimizer step); a step nbwatch skips is
            # skipped on the device, which the host learns later: the schedule moves on.
            # ReduceLROnPlateau is stepped by val_fn, with its val loss
            rec.sched.step()
        opt.zero_grad(set_to_none=True)


@dataclass
class _Micro:
    """What the micro-batches of one optimizer step leave for its measure stage."""

    loss_sum: torch.Tensor | None = None  # sum of the micro-batches' detached losses
    masks: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)  # a packed batch's
    unmasked: list[torch.Tensor] = field(default_factory=list)  # those given no mask
    rows: list[torch.Tensor] = field(default_factory=list)  # the masks of those not packed
    zeros: list[torch.Tensor] = field(default_factory=list)  # float masks: zeros alone?
    keeping: bool = False  # the masks so far kept for the record (probes/late.py)
    extras: dict[str, list[Any]] = field(default_factory=dict)  # the step_fn's scalars
    logits: list[torch.Tensor] | None = None  # [log Z, max |logit|] of the first's logits
    host: dict[str, Any] = field(default_factory=dict)  # host figures (what waits: late.py)
    tally: Tally = field(default_factory=Tally)  # its samples (`probes/combined.py`)
    reduction: str | None = None
    data_s: float = 0.0  # waiting for batches
    fwd_s: float = 0.0  # step_fn calls


_TARGET_HOW = ("pass a 0/1 (or bool) mask of the target's real tokens, 1 for a real token and 0 "
               "for padding (e.g. batch['decoder_attention_mask'], or labels != -100)")
_RESERVED = frozenset({"loss", "logits", "labels", "mask"})


def _extras(out: dict, into: dict[str, list[Any]]) -> None:
    """A step_fn dict's other one-value entries (`{"loss": ..., "accuracy": acc}`): recorded
    as `train/<name>`. Anything else it carries (hidden states, caches) is left alone."""
    for k, v in out.items():
        if k in _RESERVED or not isinstance(k, str):
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.dtype.is_complex:
            into.setdefault(k, []).append(v.detach().float().reshape(()))
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            into.setdefault(k, []).append(float(v))


def run_in_thread(target: Callable[[], Any], name: str, done: threading.Event | None = None
                  ) -> threading.Thread:
    """Start `target` in a daemon thread that keeps the caller's context (so a notebook's
    output from the thread lands in the cell that started it); `done` is set when it ends
    (an Event, because `Thread.join` interrupted by Ctrl-C can mark a live thread stopped)."""
    ctx = contextvars.copy_context()

    def body() -> None:
        try:
            ctx.run(target)
        finally:
            if done is not None:
                done.set()

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    return t
