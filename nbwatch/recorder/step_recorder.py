"""`StepRecorder`: one run's recorder, and its lifecycle (begin, a guarded loop, finish,
fail). What it does at each moment of a step lives in its parts, each a module of
functions over the protocol it declares (what it reads and moves of the run, checked by
mypy against this class), with its state in an object it owns:

    optimizer_step.py  the optimizer's hooks: measure                  Measuring · InFlight
    clip_skip.py       the clip and the skip, on the device or host     Deciding · InFlight
    step_end.py        the step's record, histograms                    Recording · InFlight
    steering.py        commands, the ranks' meeting, alert actions      Steered · Inbox,
                                                                        RankMeeting
    rewind.py          rewind and skip                                  Rewinding · RewindState
    eval_checkpoint.py evals and checkpoints                            Evaluating · EvalState
    batches.py, lr_factor.py, own_clips.py: objects of their own (BatchIds, LrFactor,
    OwnClips). The methods below are the recorder's interface for its loops."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import controls as ctl
from ..alerts.engine import AlertEngine, default_rules
from ..checkpoint import Checkpointer
from ..distributed import Dist, NullStore
from ..probes.data import LengthCounts
from ..probes.forward_time import ForwardClock
from ..probes.grads import grad_names, ratio_names
from ..probes.logits import TrainLogits
from ..records import Event
from ..store import RunStore
from . import eval_checkpoint as ec
from . import failure
from . import optimizer_step as ost
from . import steering as st
from . import step_end as se
from .batches import BatchIds
from .eval_checkpoint import EvalState
from .layer_changes import LayerWatch, describe, of_run
from .lr_factor import LrFactor
from .own_clips import OwnClips
from .own_time import OwnTime
from .spec import Progress, RunSpec, StopTraining
from .state import Inbox, InFlight, RankMeeting, RewindState

log = logging.getLogger("nbwatch.recorder")
_RUN_IDS = itertools.count(1)  # each run's logger is its own, whatever its folder's name


class StepRecorder:
    """Measures and records each optimizer step of one run, and steers it between steps."""

    def __init__(
        self,
        spec: RunSpec,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: Any,
        store: RunStore | NullStore,
        checkpointer: Checkpointer,
        commands: ctl.CommandQueue,
        control: ctl.ControlState,
        progress: Progress,
        start_step: int = 0,
        engine: AlertEngine | None = None,
        on_alert: Callable[[Event], Any] | None = None,
        dist: Dist | None = None,
    ):
        self.spec, self.model, self.opt, self.sched, self.scaler = (
            spec, model, optimizer, scheduler, scaler
        )
        self.store, self.ckpt, self.commands, self.control = store, checkpointer, commands, control
        commands.open()
        self.progress = progress
        self.engine = engine if engine is not None else AlertEngine(default_rules())
        self.on_alert = on_alert
        self.dist = dist
        self.step = self.start_step = start_step
        self.layers = of_run(model, optimizer)
        self.grad_names, self.ratio_names = grad_names(self.layers), ratio_names(self.layers)
        # a model changed mid-run (under torchrun, only where every rank sees it at one step)
        self.layer_watch = LayerWatch(model, optimizer, self.layers, distributed=dist is not None)
        self._end_recorded = False  # the store holds the run's end state (`_set_state`)
        self.log = logging.getLogger(f"nbwatch.run.{store.run_dir.name}.{next(_RUN_IDS)}")
        if isinstance(store, NullStore):  # rank 0 records the job's events: a rank's own
            self.log.addHandler(logging.NullHandler())  # not on its console (last resort)
        self.skip_nonfinite = any(r.name == "nonfinite" and "skip_step" in r.actions
                                  for r in self.engine.rules)
        self.flight = InFlight()  # a step between its optimizer hooks and its record
        self.ranks = RankMeeting()  # under torchrun: what the next exchange carries
        self.inbox = Inbox()  # which store commands were taken
        self.batch_ids = BatchIds()  # which batch each of the last steps took
        self.rewind_state = RewindState()  # rewind.py: who may, what the loop must be told
        self.evals = EvalState()  # eval_checkpoint.py: the last val loss, checkpoint
        self.lr = LrFactor(optimizer, scheduler, control)  # an LR cut around the scheduler
        self.own_clips = OwnClips(self.layers)  # norms before the loop's own clips
        self.own = OwnTime()  # nbwatch's own time on the training thread: time/nbwatch
        # the training batch's logits figures: the loop's, else the output layer's hook
        self.train_logits = TrainLogits(model, self.own, say=_weak(self.probe_note))
        self._forward_clock: ForwardClock | None = None  # forward_time(): torchrun, own loop
        self.clocked = model  # … on this module's forwards (Lightning's: its DDP wrapper)
        # called at each of a pause's meetings on rank 0 (a loop of one's own under
        # torchrun: asks the stop of a SIGTERM that came while the loop waits in log())
        self.paused_tick: Callable[[], None] | None = None
        # Set by framework adapters: False when the optimizer's pre-hook comes too early to
        # see the gradients (Lightning's closure runs backward inside optimizer.step), and
        # the adapter calls `pre_step()` itself at the framework's own moment.
        self.hook_measures = True
        # Set by framework adapters: checkpoints the framework's way; None: nbwatch's own.
        self.save_fn: Callable[[str], None] | None = None
        # Set by framework adapters: the framework's own clipping (Trainer max_grad_norm,
        # Lightning gradient_clip_val), after nbwatch's; `grad_norm/clipped` shows both.
        self.framework_clip: float | None = None

    # -- the optimizer's hooks (optimizer_step.py) ----------------------------------------
    def relayer(self, step: int) -> None:
        """At the optimizer's pre-hook: measure the layers there are now, where a param
        group was added or a layer replaced since the last step, and say so."""
        new = self.layer_watch.changed(self.layers)
        if new is None:
            return
        said = describe(step, self.layers, new, len(self.opt.param_groups))
        with self.flight.lock:  # the sampler's thread may be reading a step's names now
            self.layers = new
            self.grad_names, self.ratio_names = grad_names(new), ratio_names(new)
            self.own_clips.relayer(new)
        self.train_logits.rehook()  # the output layer may be a new module
        for derive in self.engine.derive:  # MFU: the weights that take a gradient now
            retrain = getattr(derive, "retrain", None)
            if retrain is not None:
                retrain(self.model, step)
        self._emit(Event(step, "probe", "warning", said,
                         {"layers": list(new.names), "tensors": len(new.params)}))

    @property
    def stepped(self) -> bool:
        """The optimizer stepped since the last end of step."""
        return self.flight.stepped

    def overflowed(self) -> bool:
        """Whether the GradScaler skipped the optimizer: see `optimizer_step.overflowed`."""
        return ost.overflowed(self)

    def stage(self, names: list[str], parts: list[torch.Tensor]) -> None:
        """Device figures of the step about to be taken (the runner's loss), copied to the
        host together with its gradient norms."""
        self.flight.staged = (names, parts)

    def pre_step(self, explicit: bool = True, clips: list | None = None,
                 clip_note: str | None = None, found_inf: torch.Tensor | None = None) -> None:
        """The step's gradient figures and decisions: see `optimizer_step.pre_step`."""
        ost.pre_step(self, explicit, clips, clip_note, found_inf)

    def snapshot_early(self) -> None:
        """Before a closure's step: see `optimizer_step.snapshot_early`."""
        ost.snapshot_early(self)

    def post_step(self) -> None:
        """Optimizer post-hook: update ratios, and the LR factor off for the scheduler."""
        ost.post_step(self)

    # -- the step's record (step_end.py) -------------------------------------------------
    def end_step(self, values: dict[str, float], names: list[str] | None = None,
                 parts: list[torch.Tensor] | None = None, *, data_s: float | None = None,
                 samples: int | None = None, extra_times: dict[str, float] | None = None
                 ) -> int:
        """Close the optimizer step just taken: see `step_end.end_step`."""
        return se.end_step(self, values, names, parts, data_s=data_s, samples=samples,
                           extra_times=extra_times)

    def forward_time(self) -> dict[str, float]:
        """A loop of one's own (or a framework's) under torchrun: its `time/forward` and
        `time/busy` from the forwards of `clocked` (`ForwardClock.take`: a straggler is told
        by them; start()'s runner times its own).
        Empty alone, and at the first call (the hooks go on then)."""
        if self.dist is None:
            return {}
        if self._forward_clock is None:
            self._forward_clock = ForwardClock(self.clocked)
            return {}
        # from the step's start, or the ranks' meeting after it (a wait for the slow rank)
        return self._forward_clock.take(max(self.flight.t_boundary, self.ranks.met_at))

    def forward_waits(self) -> float:
        """start() under torchrun: the seconds the model's forwards have waited so far
        before they began (DDP's buffer broadcast, FSDP2's first all-gather: another rank's
        slowness, not this one's work), which the runner leaves out of `time/forward`."""
        if self.dist is None:
            return 0.0
        if self._forward_clock is None:
            self._forward_clock = ForwardClock(self.clocked)
        return self._forward_clock.waited

    def close_hooks(self) -> None:
        """The hooks the run set on the model: the output layer's, the forward clock's."""
        self.train_logits.close()
        if self._forward_clock is not None:
            self._forward_clock.close()

    def record_step(self, host: dict[str, float], names: list[str],
                    parts: list[torch.Tensor], *,
                    lengths: torch.Tensor | LengthCounts | None = None,
                    samples: int | None = None, val: Any = None,
                    reduction: str | None = None) -> int:
        """The end of a step in a loop nbwatch does not run: see `step_end.record_step`."""
        return se.record_step(self, host, names, parts, lengths=lengths, samples=samples,
                              val=val, reduction=reduction)

    def flush_deferred(self) -> None:
        """Record every step taken so far: see `step_end.flush_deferred`."""
        se.flush_deferred(self)

    def record_if_quiet(self) -> bool:
        """From another thread: record the steps of a quiet loop (`step_end.record_if_quiet`)."""
        return se.record_if_quiet(self)

    def save_reduction(self, reduction: str | None) -> None:
        se.save_reduction(self, reduction)

    def keep_seq_lens(self, lengths: torch.Tensor | LengthCounts) -> None:
        se.keep_seq_lens(self, lengths)

    @property
    def stopping(self) -> bool:
        """A stop was taken (read off the run's state: `Progress.stopping`)."""
        return self.progress.stopping

    @property
    def ended(self) -> bool:
        """The run finished, stopped or failed (read off its state: `Progress.ended`)."""
        return self.progress.ended

    # -- steering (steering.py) ----------------------------------------------------------
    def boundary(self) -> bool:
        """Apply queued commands (pause blocks here); True once the run should stop."""
        st.apply_commands(self)
        return self.stopping

    def apply_commands(self, block: bool = True) -> None:
        st.apply_commands(self, block)

    def take_final_stop(self) -> None:
        st.take_final_stop(self)

    def expire_pending(self) -> None:
        st.expire_pending(self)

    def _raise_alerts(self, alerts: list) -> None:
        st.raise_alerts(self, alerts)

    # -- which batch (batches.py) ---------------------------------------------------------
    def note_batch(self, batch: Any, epoch: int | None = None, index: int | None = None
                   ) -> None:
        """The step being taken uses `batch` (once per micro-batch, before its end)."""
        with self.own:
            self.batch_ids.note_batch(batch, epoch, index)

    def note_logged_batch(self, batch: Any, scalars: dict[str, Any]) -> None:
        """`mon.log(batch=..., epoch=..., index=...)`: see `BatchIds.note_logged_batch`."""
        self.batch_ids.note_logged_batch(batch, scalars)

    # -- evals and checkpoints (eval_checkpoint.py) --------------------------------------
    def evaluate(self, val: Any = None) -> None:
        """The eval of this step: `val` as given (own loop) or `val_fn`, the attention
        probe, `sample_fn`; recorded, fed to the rules, checkpointed."""
        ec.run_eval(self, val)

    def step_done(self, eval_due: bool = False, val: Any = None, probe: bool = False) -> None:
        """The one policy after a step, in every loop: see `eval_checkpoint.step_done`."""
        ec.step_done(self, eval_due, val, probe)

    def probe_failed(self, message: str, severity: str = "warning") -> None:
        """The attention probe cannot work on this model: said once, then off."""
        ec.probe_failed(self, message, severity)

    def probe_note(self, missing: str, message: str, severity: str = "info") -> None:
        ec.probe_note(self, missing, message, severity)

    def note_checkpoint(self, reason: str, path: str | Path, seconds: float | None = None,
                        best: bool = False, kept: bool = True) -> None:
        """Record a checkpoint the framework wrote (a folder or a file)."""
        ec.note_checkpoint(self, reason, path, seconds, best, kept)

    def state_dict(self) -> dict[str, Any]:
        return ec.state_dict(self)

    def checkpoint(self, reason: str) -> None:
        ec.checkpoint(self, reason)

    def commit(self) -> None:
        """Every record up to this step on disk (before any checkpoint is written)."""
        ec.commit(self)

    def _checkpoint(self, reason: str, announce: bool = True) -> Event | None:
        return ec.write_checkpoint(self, reason, announce)

    # -- lifecycle ----------------------------------------------------------------------
    def begin(self, timed: bool = True) -> None:
        """The run is running; `timed`: its first step begins now (not: a loop of one's
        own, opened inside its first step, which has no time/step)."""
        self._set_state("running")
        self.flight.t_boundary, self.flight.timed = time.perf_counter(), timed

    def guarded(self, body: Callable[[], Any]) -> None:
        """Run `body` (the training loop) as this run: a clean return ends it finished (or
        stopped, if a stop was asked), `StopTraining` stopped, any other exception failed
        with its traceback and an emergency checkpoint. Never raises."""
        try:
            self.begin()
            body()
            self.take_final_stop()  # a stop the loop saw before log() took it
            self.finish("stopped" if self.stopping else "finished")
        except StopTraining:
            try:
                self.finish("stopped")
            except BaseException as e:  # noqa: BLE001 - as below
                self.fail(e)
        except BaseException as e:  # noqa: BLE001 - recorded, then re-raised by Monitor.wait()
            self.fail(e)
        finally:
            try:
                self.store.flush()
            except Exception as fe:  # never mask the training error
                log.error("final flush of the run store failed: %s", fe)

    def finish(self, outcome: str) -> None:
        """End the run as "finished" or "stopped", with a final checkpoint."""
        if self.ended:
            return
        self.train_logits.close()  # first: a failing checkpoint below must not leave it
        self.layer_watch.close()
        self.record_stepped()
        self.flush_deferred()
        if self.dist is not None:
            st.sync_ranks(self, final=True)  # may carry a stop sent since the last meeting
            outcome = "stopped" if self.stopping else outcome
        self._checkpoint("stop" if outcome == "stopped" else "final")
        self.expire_pending()
        self._set_state(outcome)

    def abandon_end(self) -> None:
        """Ctrl-C pressed again while `finish` ran: the run ends a stop without what the
        press cut short (its final checkpoint), its steps and state recorded all the same
        (a folder left 'running' would read 'stale')."""
        if self._end_recorded:
            return
        # ended from here (the press may have come after the move, before its record): what
        # is recorded below acts on nothing
        end = self.progress.state.value if self.ended else self.progress.move("stopped").value
        self.layer_watch.close()
        for record in (self.flush_deferred, self._say_abandoned,
                       lambda: self._set_state(end), self.expire_pending):
            try:
                record()
            except Exception as e:  # noqa: BLE001 - the rest is still worth recording
                self.log.error("recording the run's end failed: %s", e)

    def _say_abandoned(self) -> None:
        saved = self.ckpt.steps()
        if saved and saved[-1][0] == self.step:  # the press came after the checkpoint
            return
        where = (f"a resume starts from {saved[-1][1].name}" if saved
                 else "there is no checkpoint to resume from")
        self._emit(Event(self.step, "state", "warning", "Ctrl-C pressed twice while the run "
                         f"ended: its final checkpoint (step {self.step}) was not written; "
                         f"{where}", {"abandoned": "checkpoint"}), logging.WARNING)

    def record_stepped(self) -> None:
        """A step the optimizer took but the loop did not log (stopped between its
        `optimizer.step()` and `log()`): recorded now, without what `log()` brings, so
        that the run's last checkpoint holds its weights under its number."""
        if self.flight.stepped:
            self.end_step({})

    def ending_failed(self, e: BaseException) -> None:
        """Ending the run raised `e` before its end was recorded (on a GPU the last step's
        copy is the first sync after its kernels: an asynchronous device error comes out
        there): the run failed."""
        if not self.ended:
            with contextlib.suppress(Exception):
                self.fail(e)
                self.store.flush()

    def fail(self, e: BaseException) -> None:
        """Record `e` as the end of the run, with an emergency checkpoint."""
        failure.fail(self, e)

    def _set_state(self, state: str) -> None:
        state = self.progress.move(state).value
        self.store.set_meta("state", state)
        self.store.set_meta("step", self.step)
        self._end_recorded = self.progress.ended  # the folder says how the run ended
        if state != "running" or self.step:
            self._emit(Event(self.step, "state", "info", f"run {state} at step {self.step}",
                             {"state": state}))

    def record_event(self, ev: Event, level: int | None = None) -> None:
        """Record `ev` in the run's events and its log (what an adapter tells)."""
        self._emit(ev, level)

    def set_probe(self, batch: Any = None, fn: Callable[..., Any] | None = None) -> None:
        """The attention probe's samples and forward pass, given by a framework's adapter
        (its eval data, its module): what the next evals probe with."""
        if batch is not None:
            self.spec.probe_batch = batch
        if fn is not None:
            self.spec.probe_fn = fn

    def _emit(self, ev: Event, level: int | None = None) -> None:
        self.store.put(ev)
        lvl = level if level is not None else {
            "info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL
        }[ev.severity]
        self.log.log(lvl, ev.message, extra={"step": ev.step, "kind": ev.kind, "data": ev.data})


def _weak(method: Callable[..., None]) -> Callable[..., None]:
    """`method` without a reference to its object: a part the object owns may hold it
    without a cycle (which would keep the run's data, a DataLoader's workers, alive until
    the collector runs)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        m = ref()
        if m is not None:
            m(*args)
    return call
