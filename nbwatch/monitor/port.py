"""The interface for a loop nbwatch does not run (a framework's fit): the HF and Lightning
adapters use it and nothing else of nbwatch's insides.

    loop = mon.open_external("hf", start_step, save=..., clip=..., commands=queue)
    per micro-batch    loop.note_batch(batch)
    gradients ready    loop.measure()           (where the optimizer's own hook is too early)
    optimizer stepped  loop.logit_figures(mask); stop = loop.record_step(host, names, ...)
    eval               loop.evaluate(figures)
    checkpoint         loop.commit() before the framework writes, loop.note_checkpoint(...)
    fit returned       loop.end(error)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..probes.data import LengthCounts
from ..probes.logits import FIX
from ..recorder import RunSpec
from ..recorder.clip_skip import TOTAL
from .exiting import raise_if_terminated

if TYPE_CHECKING:
    from ..recorder import StepRecorder
    from .session import RunSession


class ExternalLoop:
    """One framework fit, as its adapter records and steers it. Opened by
    `Monitor.open_external`; every method is a moment of the framework's step."""

    def __init__(self, recorder: StepRecorder,
                 end: Callable[[BaseException | None], None], session: RunSession | None = None):
        self._rec, self._end = recorder, end  # end: the Monitor's, which closes the run
        self._session = session  # its optimizer's watch on the fit's own clips
        # the training batch's logits from a forward hook on the output layer: frameworks
        # hand their callbacks none; the first training forward of each step counts
        tl = recorder.train_logits
        tl.keep, tl.fix = "first", FIX["framework"]
        try:
            tl.watch()
        except Exception as e:  # optional figures: never the reason a fit fails to open
            recorder.log.warning("train_logits/* not recorded: the output layer's hook "
                                 "could not be set: %s: %s", type(e).__name__, e)

    # -- the step -----------------------------------------------------------------------
    def note_batch(self, batch: Any, epoch: int | None = None, index: int | None = None
                   ) -> None:
        """The step being taken uses `batch` (once per micro-batch)."""
        self._rec.note_batch(batch, epoch, index)

    def measure(self, found_inf: torch.Tensor | None = None) -> torch.Tensor | float | None:
        """The gradients are complete and not clipped yet: measure them, and let nbwatch's
        skip and clip rules act on them (the optimizer's own hook would see them later).
        `found_inf`: a GradScaler's verdict on them, once unscaled (> 0: an overflow, which
        the scaler skips: recorded as `amp/overflow`, no rule fires). Returns their global
        norm before any clip, nbwatch's or the framework's (a 0-dim tensor on their device,
        nothing read; a float on a CPU), for a framework that logs it; None where nothing
        was measured. A clip of the fit's own before it (Lightning's manual optimization:
        `self.clip_gradients(...)` before `opt.step()`) is divided out, as in a loop of
        one's own."""
        rec, s = self._rec, self._session
        clips, note = s.watch.clips.take(s.step) if s is not None else ([], None)
        rec.pre_step(found_inf=found_inf, clips=clips, clip_note=note)
        t = rec.flight.taking
        if t is None or not t.explicit or t.step != rec.step + 1:
            return None
        flags = t.read["flags"] if t.read is not None else t.groups.get("flags")
        return flags[TOTAL] if flags else None

    def measure_in_optimizer_hook(self) -> None:
        """This step's gradients are measured by the optimizer's own pre-hook instead (a
        fused optimizer under a GradScaler: its gradients are still scaled where the
        framework would measure, and the step unscales them itself)."""
        self._rec.flight.measure_in_hook = True

    def logit_figures(self, mask: torch.Tensor | None = None,
                      host: dict[str, Any] | None = None
                      ) -> tuple[list[str], list[torch.Tensor]]:
        """(names, parts) of the step's log Z and max |logit|, from the first training
        forward since the last call (`mask`: that micro-batch's, to leave its padding
        out); none where the model has no output layer, or where `host` (the step's host
        figures) keeps CPU rows for the record. In the step's `record_step`."""
        return self._rec.train_logits.parts(None, mask, host=host)

    @property
    def own(self) -> Any:
        """The clock of nbwatch's own time on the training thread (`time/nbwatch`): an
        adapter's own work of a step runs inside `with loop.own:`."""
        return self._rec.own

    @property
    def first_step(self) -> bool:
        """The step being taken is the run's first (or a resumed run's)."""
        return self._rec.step == self._rec.start_step

    @property
    def stepped(self) -> bool:
        """The optimizer stepped since the last `record_step` (False while accumulating)."""
        return self._rec.stepped

    def clock_forwards(self, module: torch.nn.Module) -> None:
        """Under torchrun, take the step's `time/forward` and `time/busy` (`record_step`)
        from the forwards of `module`, the one the framework calls for a training step,
        rather than the model's own (Lightning's strategy's DDP wrapper, whose forward runs
        `training_step`: the wait before the model's forward, DDP's broadcast of its
        buffers from rank 0, is then left out of both). Before the first `record_step`."""
        self._rec.clocked = module

    def record_step(self, host: dict[str, float], names: list[str],
                    parts: list[torch.Tensor], *,
                    lengths: torch.Tensor | LengthCounts | None = None,
                    samples: int | None = None, reduction: str | None = None) -> bool:
        """Record the optimizer step just taken (host figures, and device `parts` named
        `names`), then apply the commands (a pause blocks here). True once the fit should
        stop. Under torchrun the step's forward and busy times go with them (a
        straggler is told by them, as in a loop of one's own)."""
        host.update(self._rec.forward_time())
        self._rec.record_step(host, names, parts, lengths=lengths, samples=samples,
                              reduction=reduction)
        if self._session is not None:  # a SIGTERM's stop, under torchrun
            raise_if_terminated(self._session)
        return self._rec.boundary()

    @property
    def ended(self) -> bool:
        return self._rec.ended

    # -- evals ---------------------------------------------------------------------------
    @property
    def spec(self) -> RunSpec:
        """What the evals measure (read it; `set_probe` gives what the framework holds)."""
        return self._rec.spec

    def set_probe(self, batch: Any = None, fn: Callable[..., Any] | None = None) -> None:
        """The attention probe's fixed samples and forward pass, where the framework holds
        them (its eval data, its module's forward); None leaves one as it is."""
        self._rec.set_probe(batch, fn)

    def evaluate(self, figures: dict[str, float] | None) -> None:
        """The framework evaluated: its figures, the attention probe, the sample."""
        self._rec.evaluate(figures)

    def probe_failed(self, message: str, severity: str = "warning") -> None:
        """The attention probe cannot work on this model: said once, then off."""
        self._rec.probe_failed(message, severity)

    # -- checkpoints ---------------------------------------------------------------------
    def commit(self) -> None:
        """Everything recorded so far on disk: call before the framework writes a
        checkpoint, which must never be newer than the run's history."""
        self._rec.commit()

    def note_checkpoint(self, reason: str, path: str | Path, seconds: float | None = None,
                        best: bool = False, kept: bool = True) -> None:
        """Record a checkpoint the framework wrote; `kept`: one the framework will not
        delete (not a top-k's), which a stop at the same step may name instead of saving."""
        self._rec.note_checkpoint(reason, path, seconds, best, kept)

    # -- the LR factor ---------------------------------------------------------------------
    @property
    def scheduler(self) -> Any:
        return self._rec.sched

    def next_lrs(self) -> list[float] | None:
        """The LRs the optimizer uses at the next step, an LR cut included, where one is in
        force (None: the schedule's own LRs are the truth)."""
        rec = self._rec
        c = rec.control
        if rec.sched is None or c.lr_factor == 1.0:
            return None
        raw = c.lr_factor if c.lr_raw else 1.0  # off now: put back on before the next step
        return [g["lr"] * raw for g in rec.opt.param_groups]

    # -- the end ---------------------------------------------------------------------------
    @property
    def log(self) -> logging.Logger:
        """The run's log (its lines go to the run folder's log file)."""
        return self._rec.log

    def end(self, error: BaseException | None = None) -> None:
        """The fit returned (`None`: finished, or stopped if a stop was taken) or raised:
        record how it ended, with the final or the emergency checkpoint, and give back the
        store, the sampler and the folder's writer lock."""
        self._end(error)

    def abandon(self, why: str | BaseException) -> None:
        """Close the run as failed with `why`, without a checkpoint: the fit ended without
        telling its adapter (the model may be another fit's by now), or it raised an error
        the framework answers with a new fit from scratch (a smaller batch on an OOM)."""
        self._rec.save_fn = _no_checkpoint
        self._end(why if isinstance(why, BaseException) else RuntimeError(why))

    def note(self, message: str, severity: str = "warning") -> None:
        """Record `message` in the run's events (a warning, or `severity`, at the current
        step)."""
        from ..records import Event

        self._rec.record_event(Event(self._rec.step, "state", severity, message, {}),
                               logging.WARNING if severity != "info" else logging.INFO)


def _no_checkpoint(reason: str) -> None:
    """A save that saves nothing."""

