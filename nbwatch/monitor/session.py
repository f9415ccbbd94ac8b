"""A Monitor's run, opened and closed: the store (and its writer lock), the step recorder,
the optimizer's hooks, a resume's restore, the run log and the system sampler. How the run
ends when its process does is exiting.py's; the training thread, background.py's."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .. import controls as ctl
from ..alerts.engine import AlertEngine
from ..checkpoint import load, restore_into
from ..controls import refuse_early
from ..distributed import Dist, NullStore
from ..environment import environment
from ..interrupts import Terminated, finish_first
from ..lifecycle import LIVE, RunState
from ..logs import open_run_log
from ..notebook import after_each_cell
from ..ownership import refuse_other_thread
from ..panels.baseline import allow as allow_baselines
from ..probes.system import SystemSampler, close_nvml, gpu_names, open_nvml
from ..probes.throughput import Mfu
from ..recorder import Progress, RunSpec, StepRecorder, StopTraining
from ..records import Command, CommandKind, Event, SystemSample
from ..run import Run
from ..sharded_checkpoint import ShardedCheckpointer
from ..store import RunStore, StoreFailed, check_no_writer, is_run_dir
from .ending import finish, interrupted
from .optimizer_hooks import OptimizerWatch
from .options import NOT_GIVEN, Options
from .setup import Setup

log = logging.getLogger("nbwatch")


class RunSession:
    """One Monitor's run: opened by `start()`, `run()`, a loop's first optimizer step or a
    framework adapter; closed when it ends. One session a Monitor, one run at a time."""

    def __init__(self, setup: Setup, options: Options, *,
                 on_loop_open: Callable[[], None] = lambda: None,
                 on_distributed: Callable[[RunStore | NullStore], None] = lambda store: None
                 ) -> None:
        """`on_loop_open()`: a loop of one's own opened its run (the Monitor arms its exit,
        shows the dashboard); `on_distributed(store)`: a rank of a torchrun job opened its
        run (the Monitor handles a SIGTERM from the launcher; rank 0 records it)."""
        self.setup = setup
        self.options = options  # the run's options: start() overrides them one by one
        self.watch = OptimizerWatch(setup.optimizer, setup.model, self)  # its hooks
        self.commands = ctl.CommandQueue()
        self.progress = Progress()
        self.progress_start = 0
        self.mode: str | None = None  # "start" | "run" | "loop" once a run was opened
        self.framework: str | None = None  # an adapter's loop ("hf", "lightning")
        self.store: RunStore | NullStore | None = None
        self.recorder: StepRecorder | None = None
        self.closed = threading.Event()  # set when the run's store and sampler are closed
        self.closed.set()
        self.stop_asked = False
        self.loop_thread: threading.Thread | None = None  # where an own loop's log() runs
        self.exc_at_open: BaseException | None = None
        self.resumed_step: int | None = None  # restored when the Monitor was created
        self.resumed_data: tuple[int, int] | None = None  # a checkpoint's data position
        self.resumed_order: dict[str, Any] | None = None  # and its pass's RNG states
        self.resumed_start: dict[str, float] = {}  # and its alerts' first levels
        self.clip_asked: Any = NOT_GIVEN  # clip= given: wins over a resumed checkpoint's
        self._sampler: SystemSampler | None = None
        self._log_handler: logging.Handler | None = None
        self._cell_hook: Callable[[], None] | None = None  # the own loop's after-cell record
        self._on_loop_open = on_loop_open
        self._on_distributed = on_distributed

    # -- what the Monitor reads --------------------------------------------------------
    @property
    def name(self) -> str:
        return self.setup.name

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def state(self) -> RunState:
        return self.progress.state

    @property
    def running(self) -> bool:
        """The run is open and neither ended nor failed (paused counts as running)."""
        return self.recorder is not None and self.progress.state in LIVE

    @property
    def stopping(self) -> bool:
        rec = self.recorder
        return self.stop_asked or (rec is not None and rec.stopping)

    def resume_now(self) -> None:
        """Restore the newest checkpoint now (`Monitor(..., resume=True)`)."""
        if self.setup.rank == 0:
            check_no_writer(self.setup.run_dir)  # not another live run's checkpoint
        self.progress.step = self.resumed_step = self.restore_latest()

    def submit(self, command: Command) -> None:
        """Queue `command` for the next step boundary (refused now if it cannot apply)."""
        refuse_early(command, self.state, self.running, self.framework)
        if command.kind == CommandKind.STOP:
            self.stop_asked = True
        self.commands.put(command)

    # -- what the optimizer's hooks ask (optimizer_hooks.OptimizerWatch) ---------------
    def recorder_for_step(self, open_loop: bool = True) -> StepRecorder | None:
        """The recorder an optimizer step goes to: the run's; with `open_loop`, a loop of
        your own opens its run at its first step; None once this run ended."""
        rec = self.recorder
        if rec is None and open_loop and self.mode is None:
            rec = self.open_loop()
        return rec

    def clips_are_the_loops(self) -> bool:
        """A clip of this model's gradients is the loop's own: not the runner's (it clips
        itself), no framework's but Lightning's (a manual optimization clips before its
        step), and a run open, or opening at the loop's first optimizer step."""
        if self.framework not in (None, "lightning") or self.mode == "start":
            return False
        if self.mode is None:
            return True
        rec = self.recorder
        return rec is not None and not rec.ended

    # -- opening -----------------------------------------------------------------------

    def check_can_open(self, resume: bool) -> None:
        if self.running:
            raise RuntimeError(
                f"this Monitor is already {self.state} at step {self.step}; call stop() and "
                "wait() first, or create another Monitor with its own run_dir")
        self.closed.wait()  # the previous run's store and sampler are closed
        self.watch.take()  # from a Monitor created on it since, not running
        if self.setup.rank == 0:
            check_no_writer(self.setup.run_dir)  # before a resume touches the model
        if self.mode is not None and not resume:
            raise RuntimeError(
                f"this Monitor already ran (it is {self.state}); continue from its newest "
                "checkpoint with start(..., resume=True) or nbwatch.Monitor(..., resume=True), "
                "or create a new Monitor with its own run_dir")

    def open_loop(self, start_step: int | None = None,
                  framework: str | None = None) -> StepRecorder:
        """A loop of the user's own, in the foreground: opened at its first optimizer step
        (or by a framework adapter, at the framework's step `start_step`)."""
        rec = self.open("loop", self.options.spec(), False, self.options,
                         {"framework": framework} if framework else {}, start_step)
        rec.rewind_state.can_rewind = framework is None  # a framework keeps its own step count
        self.framework = framework
        self.loop_thread = threading.current_thread()  # a framework's fit thread, maybe
        if self.loop_thread is threading.main_thread():
            # a notebook cell's loop: its last steps are recorded when the cell ends, not
            # only at the next log() (steps are recorded in batches: step_end.py)
            self._cell_hook = after_each_cell(self.record_waiting)
        rec.begin(timed=framework is not None)  # a loop of one's own: inside its step 1
        self.exc_at_open = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        self._on_loop_open()
        return rec

    def record_waiting(self) -> None:
        """Record the steps of a loop of one's own that wait for their batch, when called
        on the loop's thread (a read of its own run, the end of a notebook cell)."""
        rec = self.recorder
        if (rec is not None and not rec.ended and self.mode == "loop"
                and self.loop_thread is threading.current_thread()):
            try:
                rec.flush_deferred()
            except Exception as e:  # a dead store: the next log() raises it in the loop
                log.warning("recording the steps that waited failed: %s", e)

    def recorder_for_log(self, run_thread: threading.Thread | None) -> StepRecorder:
        """The recorder `log()` records this step into (a GradScaler's skipped first step
        opens the loop's run here), or the error that says why there is none, or why this
        call comes at the wrong moment."""
        rec = self.recorder
        if rec is None and self.mode is None and self.setup.scaler is not None:
            rec = self.open_loop()  # the scaler skipped the first optimizer step (overflow)
        if self.mode == "start":
            raise RuntimeError(
                "mon.log() is for a training loop of your own, but this run was started "
                "with mon.start(step_fn, ...), whose runner records every step itself"
            )
        if rec is None and self.mode is None:
            raise RuntimeError(
                "mon.log() before any optimizer step: call it once per optimizer step, after "
                "optimizer.step() (nbwatch takes the gradient figures during the optimizer's "
                "own step); with a GradScaler, whose overflow skips optimizer.step(), pass it "
                "as nbwatch.Monitor(..., scaler=scaler)" + self.watch.inner_hint())
        if rec is None or rec.ended:  # a loop that caught StopTraining and went on (a
            # foreground one's run is closed at the stop): nothing more is recorded
            if self.state == RunState.STOPPED and (rec is not None or self.mode == "loop"):
                raise StopTraining(f"run {self.setup.name!r} was stopped at step {self.step}; "
                                   "log() records nothing more (end the loop)")
            raise RuntimeError(f"mon.log(): this run is {self.state} at step {self.step}"
                               + ("; create a new Monitor (resume=True to continue it)"
                                  if rec is None else ""))
        refuse_other_thread(self.loop_thread if self.mode == "loop" else
                            run_thread if self.mode == "run" else None)
        if not rec.stepped and (self.setup.scaler is None or not rec.overflowed()):
            amp = "" if self.setup.scaler is not None else (
                "; with a GradScaler (whose overflow skips optimizer.step()), pass it as "
                "nbwatch.Monitor(..., scaler=scaler)")
            if rec.step == self.progress_start:
                raise RuntimeError(
                    "mon.log() before any optimizer step: call it once per optimizer step, "
                    "after optimizer.step()" + amp + self.watch.inner_hint())
            raise RuntimeError(
                f"mon.log() twice for one optimizer step (step {rec.step}): call it once per "
                "optimizer step, after optimizer.step(); with gradient accumulation, after "
                "the step that follows the last micro-batch" + amp)
        return rec

    def open(self, mode: str, spec: RunSpec, resume: bool, opts: Options,
              run_meta: dict[str, Any], start_step: int | None = None) -> StepRecorder:
        """Open a run: the store, the recorder, the run log and the system sampler.
        `start_step`: where a framework that restored its own checkpoint stands."""
        dist = Dist.detect(opts.rank_every, opts.dist_timeout)  # collective: every rank's
        given = self.setup
        ckpt = given.checkpointer
        if dist is not None and isinstance(ckpt, ShardedCheckpointer):
            ckpt.open_run(dist)  # FSDP2: nbwatch's group (its timeout), a folder all share
        # the options in force (start()'s max_steps comes in its spec)
        run_meta = {**run_meta, "options": {**opts.record(), "max_steps": spec.max_steps}}
        if start_step is None:
            start_step = self.start_step(resume)
        if self.clip_asked is not NOT_GIVEN:  # from step 1, and over a resumed checkpoint's
            self.setup.control.clip, self.clip_asked = self.clip_asked, NOT_GIVEN  # once
        rules = self.setup.rules
        mfu = Mfu.of(self.setup.model, opts.peak_flops)
        run_meta = {**run_meta, "flops": mfu.meta()}
        if dist is not None:  # decisions that need no exchange must see the same inputs: the
            # synchronised gradients, not a rank's own loss
            rules = [replace(r, params={**r.params, "keys": ("grad_norm/global",)})
                     if r.same_on_every_rank and "keys" in r.params else r for r in rules]
            if dist.rank != 0:
                rules = [r for r in rules if r.same_on_every_rank]
        self.progress = Progress(step=start_step, state=RunState.STARTING)
        self.progress_start = start_step
        self.stop_asked = False
        self.closed.clear()
        store: RunStore | NullStore
        try:
            if dist is not None and dist.rank != 0:
                store = self.store = NullStore(self.setup.run_dir, dist.rank)
            else:
                store = self.open_store(start_step, spec.max_steps, {
                    **run_meta, "mode": mode, "world_size": dist.world if dist else 1,
                    "backend": dist.backend if dist else None})
            rec = StepRecorder(
                spec, given.model, given.optimizer, given.scheduler, given.scaler, store,
                ckpt, self.commands, given.control, self.progress, start_step,
                AlertEngine(rules, derive=[mfu], start=self.resumed_start), given.on_alert,
                dist)
            self.recorder, self.mode = rec, mode
            if mode == "start" and start_step:  # the runner skips to where the data stood
                rw = rec.rewind_state
                rw.data_at, rw.data_order = self.resumed_data, self.resumed_order
            self.watch.open_run()
            if self.setup.rank == 0:  # said at the first step with tokens/s (and TFLOP/s)
                mfu.say = lambda step, note: store.put(Event(step, "state", "info", note))
            if self.setup.rank == 0:
                self._log_handler = open_run_log(rec.log, self.setup.run_dir)
                self._sampler = SystemSampler(self.record_system,
                                              self.setup.system_interval).start()
            if dist is not None:
                self._on_distributed(store)
        except BaseException:  # nothing opened may outlive a start that failed
            self.close_run()
            self.mode, self.progress = None, Progress(step=start_step, state=RunState.CREATED)
            raise
        return rec

    def start_step(self, resume: bool) -> int:
        if self.resumed_step is not None:  # restored when the Monitor was created
            step, self.resumed_step = self.resumed_step, None
            return step
        if resume:
            return self.restore_latest()
        held = self.recorded_step()
        if held:
            check_no_writer(self.setup.run_dir)  # a live run there: RunInUse, not "resume=True"
            if self.setup.checkpointer.latest() is None:
                raise FileExistsError(
                    f"run_dir {self.setup.run_dir} already holds a run at step {held} that "
                    "ended before its first checkpoint, so it cannot be continued: choose a "
                    "new run_dir, or delete this folder to start over")
            raise FileExistsError(
                f"run_dir {self.setup.run_dir} already holds a run at step {held}; "
                "pass resume=True to continue it, or choose a new run_dir"
            )
        return 0

    def recorded_step(self) -> int:
        """The last step the run folder holds (0 for a new or empty folder; rank 0 reads)."""
        if self.setup.rank != 0 or not is_run_dir(self.setup.run_dir):
            return 0
        return Run(self.setup.run_dir).step

    def restore_latest(self) -> int:
        latest = self.setup.checkpointer.latest()
        if latest is None:
            held = self.recorded_step()
            if held:
                raise FileNotFoundError(
                    f"resume=True but the run in {self.setup.run_dir} ended at step {held} "
                    "before its first checkpoint, so there is nothing to continue from: start "
                    "again in a new run_dir, or delete this folder to start over")
            raise FileNotFoundError(
                f"resume=True but {self.setup.checkpointer.dir} holds no checkpoint; start "
                "without resume, or pass the run_dir of the run to continue"
            )
        return self.restore(load(latest))

    def close_run(self) -> None:
        rec, sampler, store, handler = (self.recorder, self._sampler, self.store,
                                        self._log_handler)
        self.recorder = self._sampler = self._log_handler = None
        if self._cell_hook is not None:
            self._cell_hook()
            self._cell_hook = None
        self.watch.close_run()  # other optimizers free; torch's clipping torch's
        if rec is not None:
            rec.close_hooks()  # the output layer's hook, if the run's end left it
        try:
            if sampler is not None:
                sampler.stop()
            if store is not None:
                store.close()
            if rec is not None and rec.dist is not None:
                rec.dist.close()  # nbwatch's own gloo group: its threads must not outlive us
        finally:
            if handler is not None and rec is not None:
                rec.log.removeHandler(handler)
                with contextlib.suppress(OSError):  # a full disk: the store said so already
                    handler.close()
            self.closed.set()

    def end_loop(self, exc: BaseException | None) -> None:
        """End a foreground loop run: finished, stopped, or failed with `exc`."""
        rec = self.recorder
        if self.mode != "loop" or rec is None:
            return
        with finish_first("the final checkpoint and the run's last records are written",
                          interrupted=isinstance(exc, KeyboardInterrupt)):
            self.end_loop_now(rec, exc)

    def end_loop_now(self, rec: StepRecorder, exc: BaseException | None) -> None:
        try:
            clean_exit = isinstance(exc, SystemExit) and exc.code in (0, None)
            if rec.ended:  # stopped at log(), or failed already
                pass
            elif exc is None or isinstance(exc, StopTraining) or clean_exit:
                rec.take_final_stop()  # a stop the loop saw before log() took it
                finish(rec, "stopped" if rec.stopping else "finished")
            elif isinstance(exc, (KeyboardInterrupt, Terminated)):  # a stop, not a crash: its
                # reason said first, before the checkpoint (Ctrl-C; a SIGTERM)
                finish(rec, "stopped", exc.why if isinstance(exc, Terminated)
                       else interrupted(self.step))
            else:
                rec.fail(exc)
            rec.store.flush()
        except StoreFailed as e:  # a dead store: the loop's own exception matters more
            log.error("closing the run store of %s failed: %s", self.setup.name, e)
        except Exception as e:  # the run failed; the loop is told unless it raised already
            rec.ending_failed(e)
            if exc is None:
                raise
            log.error("ending the run %s failed: %s", self.setup.name, e)
        finally:
            self.close_run()

    def open_store(self, start_step: int, max_steps: int | None,
                   run: dict[str, Any]) -> RunStore:
        given = self.setup
        self.store = None
        self.store = store = RunStore(given.run_dir)
        held = self.recorded_step()
        if start_step or held:  # a resume, or a framework's fit over its own last try
            store.truncate_after(start_step)
        if held > start_step:  # a kill after the checkpoint: those steps are trained again
            store.put(Event(start_step, "state", "warning", (
                f"the folder held steps {start_step + 1}–{held}, recorded after " + (
                    f"the checkpoint this run resumes from (step {start_step})" if start_step
                    else "an earlier try's start") + ": dropped, and trained again"),
                {"dropped": [start_step + 1, held]}))
        nvml, handles = open_nvml()
        names = gpu_names(nvml, handles)
        close_nvml(nvml)
        store.set_meta("name", given.name)
        config = dict(given.config)
        if given.control.clip is not None:  # a setting of the run: compare() shows it
            config.setdefault("clip", given.control.clip)
        store.set_meta("config", config)
        baselines = given.baselines
        store.set_meta("baselines", [str(p) for p in baselines])
        allow_baselines(given.run_dir, baselines)  # given here: drawn even if not beside it
        store.set_meta("environment", environment(names))
        store.set_meta("max_steps", max_steps)
        now = time.time()
        store.set_meta("opened", now)  # this writer's open: a resume's too
        if not (start_step or held) or "started" not in store.meta():  # the run's first
            store.set_meta("started", now)
        store.set_meta("pid", os.getpid())  # lets attach() tell a killed writer at once
        store.set_meta("host", socket.gethostname())
        store.set_meta("run", {
            **run, "keep_last": given.checkpointer.keep_last, "resumed_from": start_step or None,
            "model": type(given.model).__name__, "optimizer": type(given.optimizer).__name__,
            "scheduler": type(given.scheduler).__name__ if given.scheduler is not None else None,
            "parameters": sum(p.numel() for p in given.model.parameters()), "trainable": sum(
                p.numel() for p in given.model.parameters() if p.requires_grad),
        })
        return store

    def restore(self, ckpt: dict[str, Any]) -> int:
        data = ckpt.get("data")  # start()'s data stream at that step: (epoch, next batch)
        self.resumed_data = (int(data[0]), int(data[1])) if data else None
        self.resumed_order = ckpt.get("data_order")
        self.resumed_start = ckpt.get("alert_start") or {}
        given = self.setup
        return restore_into(ckpt, given.model, given.optimizer, given.scheduler, given.scaler,
                            given.control, given.checkpointer.dir,
                            group=given.checkpointer.group)

    def record_system(self, figures: dict[str, float]) -> None:
        """The sampler's reading (its thread); and the steps a quiet loop left waiting for
        their batch (its own eval, a slow batch), recorded: readers see them, a kill keeps them."""
        if self.store is not None:  # on its own wall-clock timeline: a long step keeps all
            self.store.put(SystemSample(figures, self.progress.step))
        rec = self.recorder
        if rec is not None:
            try:
                rec.record_if_quiet()
            except Exception as e:  # a dead store: the loop's next step raises it
                log.warning("recording the steps of a quiet loop failed: %s", e)

