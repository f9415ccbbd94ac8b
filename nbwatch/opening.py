"""How a Monitor's run opens and closes: the store (and its writer lock), the step
recorder, a resume's restore, the run log and the system sampler (how it ends when its
process does: exiting.py). A part of `Monitor`: the state it reads and sets is declared
in monitor_state.py."""

from __future__ import annotations

import atexit
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

from ._omp import release_caller_pool
from .alerts.engine import AlertEngine
from .checkpoint import load, restore_into
from .distributed import Dist, NullStore
from .environment import environment
from .interrupts import finish_first
from .lifecycle import RunState
from .logs import open_run_log
from .monitor_state import MonitorState
from .notebook import after_each_cell, in_notebook, remember
from .options import NOT_GIVEN, Options
from .panels.baseline import allow as allow_baselines
from .probes.system import SystemSampler, close_nvml, gpu_names, open_nvml
from .probes.throughput import Mfu, peak_flops
from .recorder import Progress, RunSpec, StepRecorder, StopTraining
from .records import SystemSample
from .run import Run
from .runner import run_in_thread
from .store import RunStore, StoreFailed, check_no_writer, is_run_dir

log = logging.getLogger("nbwatch")


def refuse_other_thread(loop: threading.Thread | None) -> None:
    """`log()` records the optimizer step the loop just took: from another thread (a
    logger, a callback's thread) it would be taken as that step's record."""
    here = threading.current_thread()
    if loop is not None and loop is not here and loop.is_alive():
        raise RuntimeError(
            f"mon.log() was called from thread {here.name!r} while the training loop runs in "
            f"{loop.name!r}: log() records the optimizer step the loop just took, so call it "
            "in the loop, once after each optimizer.step()")


class RunOpening(MonitorState):
    """Opening and closing one run of a Monitor (see `Monitor` for the attributes)."""

    def _check_can_open(self, resume: bool) -> None:
        if self.running:
            raise RuntimeError(
                f"this Monitor is already {self.state} at step {self.step}; call stop() and "
                "wait() first, or create another Monitor with its own run_dir")
        self._closed.wait()  # the previous run's store and sampler are closed
        self._optimizer_watch.take()  # from a Monitor created on it since, not running
        if self._rank == 0:
            check_no_writer(self.run_dir)  # before a resume touches the model
        if self._mode is not None and not resume:
            raise RuntimeError(
                f"this Monitor already ran (it is {self.state}); continue from its newest "
                "checkpoint with start(..., resume=True) or nbwatch.Monitor(..., resume=True), "
                "or create a new Monitor with its own run_dir")

    def _open_loop(self, start_step: int | None = None,
                   framework: str | None = None) -> StepRecorder:
        """A loop of the user's own, in the foreground: opened at its first optimizer step
        (or by a framework adapter, at the framework's step `start_step`)."""
        rec = self._open("loop", self._options.spec(), False, self._options,
                         {"framework": framework} if framework else {}, start_step)
        rec.rewind_state.can_rewind = framework is None  # a framework keeps its own step count
        self._framework = framework
        self._loop_thread = threading.current_thread()  # a framework's fit thread, maybe
        if self._loop_thread is threading.main_thread():
            # a notebook cell's loop: its last steps are recorded when the cell ends, not
            # only at the next log() (steps are recorded in batches: step_end.py)
            self._cell_hook = after_each_cell(self._record_waiting)
        rec.begin()
        self._exc_at_open = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        atexit.register(self._at_exit)
        self._after_open(self._options.display)
        return rec

    def _record_waiting(self) -> None:
        """Record the steps of a loop of one's own that wait for their batch, when called
        on the loop's thread (a read of its own run, the end of a notebook cell)."""
        rec = self._recorder
        if (rec is not None and not rec.ended and self._mode == "loop"
                and self._loop_thread is threading.current_thread()):
            try:
                rec.flush_deferred()
            except Exception as e:  # a dead store: the next log() raises it in the loop
                log.warning("recording the steps that waited failed: %s", e)

    def _recorder_for_log(self) -> StepRecorder:
        """The recorder `log()` records this step into (a GradScaler's skipped first step
        opens the loop's run here), or the error that says why there is none, or why this
        call comes at the wrong moment."""
        rec = self._recorder
        if rec is None and self._mode is None and self.scaler is not None:
            rec = self._open_loop()  # the scaler skipped the first optimizer step (overflow)
        if self._mode == "start":
            raise RuntimeError(
                "mon.log() is for a training loop of your own, but this run was started "
                "with mon.start(step_fn, ...), whose runner records every step itself"
            )
        if rec is None and self._mode is None:
            raise RuntimeError(
                "mon.log() before any optimizer step: call it once per optimizer step, "
                "after optimizer.step() (nbwatch takes the gradient figures during the "
                "optimizer's own step); with a GradScaler, whose overflow skips "
                "optimizer.step(), pass it as nbwatch.Monitor(..., scaler=scaler)")
        if rec is None or rec.ended:  # a loop that caught StopTraining and went on (a
            # foreground one's run is closed at the stop): nothing more is recorded
            if self.state == RunState.STOPPED and (rec is not None or self._mode == "loop"):
                raise StopTraining(f"run {self.name!r} was stopped at step {self.step}; "
                                   "log() records nothing more (end the loop)")
            raise RuntimeError(f"mon.log(): this run is {self.state} at step {self.step}"
                               + ("; create a new Monitor (resume=True to continue it)"
                                  if rec is None else ""))
        refuse_other_thread(self._loop_thread if self._mode == "loop" else
                            self._thread if self._mode == "run" else None)
        if not rec.stepped and (self.scaler is None or not rec.overflowed()):
            amp = "" if self.scaler is not None else (
                "; with a GradScaler (whose overflow skips optimizer.step()), pass it as "
                "nbwatch.Monitor(..., scaler=scaler)")
            if rec.step == self._progress_start:
                raise RuntimeError(
                    "mon.log() before any optimizer step: call it once per optimizer step, "
                    "after optimizer.step()" + amp)
            raise RuntimeError(
                f"mon.log() twice for one optimizer step (step {rec.step}): call it once per "
                "optimizer step, after optimizer.step(); with gradient accumulation, after "
                "the step that follows the last micro-batch" + amp)
        return rec

    def _open(self, mode: str, spec: RunSpec, resume: bool, opts: Options,
              run_meta: dict[str, Any], start_step: int | None = None) -> StepRecorder:
        """Open a run: the store, the recorder, the run log and the system sampler.
        `start_step`: where a framework that restored its own checkpoint stands."""
        dist = Dist.detect(opts.rank_every, opts.dist_timeout)  # collective: every rank's
        if dist is not None and self.checkpointer.every_rank:  # FSDP2's shards: its timeout
            self.checkpointer.group = dist.group
        run_meta = {**run_meta, "options": opts.record()}  # the options in force
        if start_step is None:
            start_step = self._start_step(resume)
        if self._clip_asked is not NOT_GIVEN:  # from step 1, and over a resumed checkpoint's
            self.control.clip, self._clip_asked = self._clip_asked, NOT_GIVEN  # once
        self.control.paused = False  # a run stopped (or interrupted) while paused ended so
        rules = self.rules
        mfu = self._mfu(opts)
        run_meta = {**run_meta, "flops": {"n_params": mfu.n, "layers": mfu.layers,
                                          "d_model": mfu.d, "ctx": mfu.ctx,
                                          "peak_flops": mfu.peak}}
        if dist is not None:  # decisions that need no exchange must see the same inputs: the
            # synchronised gradients, not a rank's own loss
            rules = [replace(r, params={**r.params, "keys": ("grad_norm/global",)})
                     if r.same_on_every_rank and "keys" in r.params else r for r in rules]
            if dist.rank != 0:
                rules = [r for r in rules if r.same_on_every_rank]
        self._progress = Progress(step=start_step, state=RunState.STARTING)
        self._progress_start = start_step
        self._stop_asked = False
        self._closed.clear()
        store: RunStore | NullStore
        try:
            if dist is not None and dist.rank != 0:
                store = self._store = NullStore(self.run_dir, dist.rank)
            else:
                store = self._open_store(start_step, spec.max_steps, {
                    **run_meta, "mode": mode, "world_size": dist.world if dist else 1,
                    "backend": dist.backend if dist else None})
            rec = StepRecorder(
                spec, self.model, self.optimizer, self.scheduler, self.scaler, store,
                self.checkpointer, self._commands, self.control, self._progress, start_step,
                AlertEngine(rules, derive=[mfu]), self._on_alert, dist,
            )
            self._recorder, self._mode = rec, mode
            if mode == "start" and start_step:  # the runner skips to where the data stood
                rec.rewind_state.data_at = self._resumed_data
            self._optimizer_watch.open_run()
            if self._rank == 0:
                self._log_handler = open_run_log(rec.log, self.run_dir)
                self._sampler = SystemSampler(self._record_system,
                                              self._system_interval).start()
            if dist is not None and self._rank == 0:
                self._record_sigterm(store)
        except BaseException:  # nothing opened may outlive a start that failed
            self._close_run()
            self._mode, self._progress = None, Progress(step=start_step, state=RunState.CREATED)
            raise
        return rec

    def _mfu(self, opts: Options) -> Mfu:
        """MFU's figures for this model: the peak given, else the GPU's by its name (None on
        a CPU or an unknown GPU: TFLOP/s alone)."""
        peak = opts.peak_flops
        dev = next((p.device for p in self.model.parameters()), None)
        if peak is None and dev is not None and dev.type == "cuda":
            import torch

            peak = peak_flops(torch.cuda.get_device_name(dev))
        return Mfu.of(self.model, peak)

    def _in_thread(self, target: Callable[[], Any]) -> None:
        release_caller_pool()
        self._done = threading.Event()
        self._thread = run_in_thread(target, f"nbwatch-train-{self.name}", self._done)
        # Closes the sampler and the store when training ends, even if nobody calls wait().
        self._finalizer = threading.Thread(target=self._finish, args=(self._done,),
                                           name="nbwatch-finish", daemon=True)
        self._finalizer.start()
        atexit.register(self._stop_at_exit)

    def _after_open(self, display: bool | None) -> Any:
        if self._rank != 0:
            return self
        remember(self)  # `%nbwatch` shows the newest run
        if display is None:
            display = in_notebook()
        if display:
            self.show()
        return self

    def _start_step(self, resume: bool) -> int:
        if self._resumed_step is not None:  # restored when the Monitor was created
            step, self._resumed_step = self._resumed_step, None
            return step
        if resume:
            return self._restore_latest()
        held = self._recorded_step()
        if held:
            check_no_writer(self.run_dir)  # a live run there: RunInUse, not "resume=True"
            if self.checkpointer.latest() is None:
                raise FileExistsError(
                    f"run_dir {self.run_dir} already holds a run at step {held} that ended "
                    "before its first checkpoint, so it cannot be continued: choose a new "
                    "run_dir, or delete this folder to start over")
            raise FileExistsError(
                f"run_dir {self.run_dir} already holds a run at step {held}; "
                "pass resume=True to continue it, or choose a new run_dir"
            )
        return 0

    def _recorded_step(self) -> int:
        """The last step the run folder holds (0 for a new or empty folder; rank 0 reads)."""
        if self._rank != 0 or not is_run_dir(self.run_dir):
            return 0
        return Run(self.run_dir).step

    def _restore_latest(self) -> int:
        latest = self.checkpointer.latest()
        if latest is None:
            held = self._recorded_step()
            if held:
                raise FileNotFoundError(
                    f"resume=True but the run in {self.run_dir} ended at step {held} before "
                    "its first checkpoint, so there is nothing to continue from: start again "
                    "in a new run_dir, or delete this folder to start over")
            raise FileNotFoundError(
                f"resume=True but {self.checkpointer.dir} holds no checkpoint; start "
                "without resume, or pass the run_dir of the run to continue"
            )
        return self._restore(load(latest))

    def _finish(self, done: threading.Event) -> None:
        """Close what one run opened, once its training thread has ended."""
        done.wait()
        self._close_run()
        atexit.unregister(self._stop_at_exit)

    def _close_run(self) -> None:
        rec, sampler, store, handler = (self._recorder, self._sampler, self._store,
                                        self._log_handler)
        self._recorder = self._sampler = self._log_handler = None
        if self._cell_hook is not None:
            self._cell_hook()
            self._cell_hook = None
        self._optimizer_watch.close_run()  # other optimizers free; torch's clipping torch's
        if rec is not None:
            rec.train_logits.close()  # the output layer's hook, if the run's end left it
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
            self._closed.set()

    def _end_loop(self, exc: BaseException | None) -> None:
        """End a foreground loop run: finished, stopped, or failed with `exc`."""
        rec = self._recorder
        if self._mode != "loop" or rec is None:
            return
        atexit.unregister(self._at_exit)
        with finish_first("the final checkpoint and the run's last records are written",
                          interrupted=isinstance(exc, KeyboardInterrupt)):
            self._end_loop_now(rec, exc)

    def _end_loop_now(self, rec: StepRecorder, exc: BaseException | None) -> None:
        try:
            clean_exit = isinstance(exc, SystemExit) and exc.code in (0, None)
            if rec.ended:  # stopped at log(), or failed already
                pass
            elif exc is None or isinstance(exc, StopTraining) or clean_exit:
                rec.take_final_stop()  # a stop the loop saw before log() took it
                _finish(rec, "stopped" if rec.stopping else "finished")
            elif isinstance(exc, KeyboardInterrupt):
                _finish(rec, "stopped")  # the user's Ctrl-C: a stop, not a crash
            else:
                rec.fail(exc)
            rec.store.flush()
        except StoreFailed as e:  # a dead store: the loop's own exception matters more
            log.error("closing the run store of %s failed: %s", self.name, e)
        except Exception as e:  # the run failed; the loop is told unless it raised already
            rec.ending_failed(e)
            if exc is None:
                raise
            log.error("ending the run %s failed: %s", self.name, e)
        finally:
            self._close_run()

    def _open_store(self, start_step: int, max_steps: int | None,
                    run: dict[str, Any]) -> RunStore:
        self._store = None
        self._store = store = RunStore(self.run_dir)
        if start_step or self._recorded_step():  # a framework's fit over its own last try
            store.truncate_after(start_step)
        nvml, handles = open_nvml()
        names = gpu_names(nvml, handles)
        close_nvml(nvml)
        store.set_meta("name", self.name)
        config = dict(self.config)
        if self.control.clip is not None:  # a setting of the run: compare() shows it
            config.setdefault("clip", self.control.clip)
        store.set_meta("config", config)
        baselines = getattr(self, "_baselines", [])
        store.set_meta("baselines", [str(p) for p in baselines])
        allow_baselines(self.run_dir, baselines)  # given here: drawn even if not beside it
        store.set_meta("environment", environment(names))
        store.set_meta("max_steps", max_steps)
        store.set_meta("started", time.time())
        store.set_meta("pid", os.getpid())  # lets attach() tell a killed writer at once
        store.set_meta("host", socket.gethostname())
        store.set_meta("run", {
            **run, "keep_last": self.checkpointer.keep_last, "resumed_from": start_step or None,
            "model": type(self.model).__name__, "optimizer": type(self.optimizer).__name__,
            "scheduler": type(self.scheduler).__name__ if self.scheduler is not None else None,
            "parameters": sum(p.numel() for p in self.model.parameters()),
        })
        return store

    def _restore(self, ckpt: dict[str, Any]) -> int:
        data = ckpt.get("data")  # start()'s data stream at that step: (epoch, next batch)
        self._resumed_data = (int(data[0]), int(data[1])) if data else None
        return restore_into(ckpt, self.model, self.optimizer, self.scheduler, self.scaler,
                            self.control, self.checkpointer.dir)

    def _record_system(self, figures: dict[str, float]) -> None:
        if self._store is not None:  # on its own wall-clock timeline: a long step keeps all
            self._store.put(SystemSample(figures, self._progress.step))


def _finish(rec: StepRecorder, outcome: str) -> None:
    """`rec.finish(outcome)`; Ctrl-C pressed a second time while it runs (`finish_first`)
    abandons its final checkpoint, and the run ends a stop all the same."""
    try:
        rec.finish(outcome)
    except KeyboardInterrupt:
        rec.abandon_end()
        raise
