"""`Monitor`: wires a model and optimizer to the step recorder, the store and (in a
notebook) the dashboard; its control methods are what the buttons call.

Three ways to drive it, one recorder underneath: `start(step_fn, data)` (nbwatch runs the
loop), `run(train)` (the user's loop, with `log()` once per optimizer step, in a
background thread), or the user's loop in the foreground (`with Monitor(...) as mon:`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import controls as ctl
from ._omp import release_caller_pool
from .alerts import AlertEngine, configure, default_rules
from .checkpoint import Checkpointer, load, set_rng_state
from .distributed import Dist, NullStore
from .environment import environment
from .inputs import (
    check_every,
    check_monitor,
    check_run_dir,
    default_run_dir,
    log_figures,
    probe_samples,
    rank,
)
from .logs import open_run_log
from .notebook import in_notebook, remember
from .probes.system import SystemSampler, close_nvml, gpu_names, open_nvml
from .recorder import SAME_ON_EVERY_RANK, Progress, RunSpec, StepRecorder, StopTraining, plain
from .records import Command, Event, Scalars
from .run import Readout, Run
from .runner import Runner, run_in_thread
from .store import DB_NAME, RunStore, check_no_writer, is_run_dir

log = logging.getLogger("nbwatch")
_LIVE = ("starting", "running", "paused")
# The Monitor whose hooks are on each optimizer: one at a time (a cell run twice makes a
# second Monitor on the same optimizer; the first one's hooks must go).
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Monitor(ctl.Controls, Readout):
    """Train in a background thread while every step is measured into `run_dir`.

    >>> mon = nbwatch.Monitor(model, optimizer, scheduler, run_dir="runs/exp1",
    ...                       config={"lr": 3e-4})
    >>> mon.start(step_fn, loader, max_steps=2000, val_fn=val_fn, eval_every=200)
    >>> mon.pause(); mon.scale_lr(0.5); mon.resume()
    >>> mon.wait()          # blocks: in a notebook this also blocks the buttons

    Or keep your own loop, with one line in it:

    >>> def train():
    ...     for batch in loader:
    ...         loss = model(**batch).loss; loss.backward()
    ...         optimizer.step(); scheduler.step(); optimizer.zero_grad()
    ...         mon.log(loss=loss, mask=batch["attention_mask"])
    >>> mon.run(train)      # or call train() yourself, inside `with mon:`

    The keyword arguments from `resume` on configure a loop of your own (`start()` takes
    its own): `resume=True` loads the newest checkpoint of `run_dir` now (`mon.step` says
    where the loop stands); `probe_batch` (+ `probe_fn(model, batch)`) gives the attention
    probe its fixed samples, run at each `log(val=...)`; `checkpoint_every` steps.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        run_dir: str | os.PathLike | None = None,
        config: dict[str, Any] | None = None,
        *,
        scaler: Any = None,
        name: str | None = None,
        keep_last: int = 3,
        system_interval: float = 1.0,
        clip: float | None = None,
        alerts: dict[str, Any] | None = None,
        on_alert: Callable[[Any], Any] | None = None,
        resume: bool = False,
        max_steps: int | None = None,
        probe_batch: Any = None,
        probe_fn: Callable[[nn.Module, Any], Any] | None = None,
        probe_tokens: list[list[str]] | None = None,
        attention_samples: int = 2,
        attention_tokens: int = 64,
        hist_every: int = 50,
        checkpoint_every: int | None = None,
        log_every: int = 50,
        rank_every: int = 10,
        dist_timeout: float = 60.0,
        display: bool | None = None,
    ):
        check_monitor(model, optimizer, scheduler, config, keep_last, system_interval)
        check_every(max_steps=max_steps, checkpoint_every=checkpoint_every)
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        # absolute now: a later os.chdir must not send the run (or mon.df) elsewhere
        self.run_dir = (Path(run_dir) if run_dir is not None else default_run_dir()).absolute()
        self.rank = rank()
        if self.rank == 0:  # under torchrun, rank 0 alone writes the run folder
            check_run_dir(self.run_dir)
        self.name = name or self.run_dir.name
        self.config = dict(config or {})
        self.system_interval = system_interval
        self.rules = configure(default_rules(), alerts)  # validates the overrides now
        self.on_alert = on_alert
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep_last)
        self.control = ctl.ControlState()
        self._clip_asked = ctl.check_clip(clip)  # wins over a resumed checkpoint's
        self._commands = ctl.CommandQueue()
        self._progress = Progress()
        self._store: RunStore | None = None
        self._thread: threading.Thread | None = None
        self._done: threading.Event | None = None  # set when the training thread ends
        self._closed = threading.Event()  # set when the run's store and sampler are closed
        self._closed.set()
        self._sampler: SystemSampler | None = None
        self._log_handler: logging.Handler | None = None
        self._finalizer: threading.Thread | None = None
        self._recorder: StepRecorder | None = None
        self._mode: str | None = None  # "start" | "run" | "loop" once a run was opened
        self._stop_asked = False
        self._resumed_step: int | None = None
        self._progress_start = 0
        self._exc_at_open: BaseException | None = None
        self._loop_options = {
            "max_steps": max_steps, "probe_fn": probe_fn, "probe_tokens": probe_tokens,
            "attention_samples": attention_samples, "attention_tokens": attention_tokens,
            "hist_every": hist_every, "checkpoint_every": checkpoint_every,
            "log_every": log_every, "probe_batch": probe_samples(probe_batch,
                                                                  attention_samples),
        }
        self._dist_options = (rank_every, dist_timeout)
        self._display = display
        self._param_ids = {id(p) for p in model.parameters()}
        self._foreign_ok: weakref.WeakSet = weakref.WeakSet()
        previous = _OWNERS.get(optimizer)
        if previous is not None and previous is not self:
            if previous.running:
                raise RuntimeError(
                    f"this optimizer is watched by a running Monitor ({previous.name!r}, "
                    f"{previous.state} at step {previous.step}); stop() and wait() it first")
            previous._remove_hooks()
        _OWNERS[optimizer] = self
        self._inside_step: int | None = None  # the thread inside optimizer.step, if any
        self._hooks = [optimizer.register_step_pre_hook(self._pre_hook),
                       optimizer.register_step_post_hook(self._post_hook)]
        self._global_hook: Any = None
        if resume:
            if self.rank == 0:
                check_no_writer(self.run_dir)  # not another live run's checkpoint
            self._progress.step = self._resumed_step = self._restore_latest()

    # -- the optimizer's own step ---------------------------------------------------------
    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._inside_step = threading.get_ident()
        rec = self._recorder
        if rec is None:
            if self._mode is not None:
                return  # this Monitor's run has ended: later steps are not recorded
            rec = self._open_loop()
        if rec.hook_measures:
            rec.pre_step(explicit=False)

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._inside_step = None
        if self._recorder is not None:
            self._recorder.post_step()

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _foreign_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if optimizer is self.optimizer or optimizer in self._foreign_ok:
            return
        if self._inside_step == threading.get_ident():
            return  # a wrapper's inner optimizer (ZeroRedundancyOptimizer, Lookahead…)
        if any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError(
                f"a second optimizer ({type(optimizer).__name__}) steps parameters of the "
                f"monitored model, but the Monitor was given {type(self.optimizer).__name__}; "
                "nbwatch measures and steers one optimizer: put all parameter groups in the "
                "optimizer you pass to nbwatch.Monitor"
            )
        self._foreign_ok.add(optimizer)

    # -- lifecycle ----------------------------------------------------------------------
    def start(
        self,
        step_fn: Callable[[nn.Module, Any], Any],
        train_data: Iterable,
        max_steps: int,
        val_fn: Callable[[nn.Module], Any] | None = None,
        eval_every: int | None = None,
        sample_fn: Callable[[nn.Module], str] | None = None,
        resume: bool = False,
        *,
        accumulate: int = 1,
        clip: float | None = None,
        hist_every: int = 50,
        checkpoint_every: int | None = None,
        probe_batch: Any = None,
        probe_fn: Callable[[nn.Module, Any], Any] | None = None,
        dry_run: bool = True,
        probe_tokens: list[list[str]] | None = None,
        attention_samples: int = 2,
        attention_tokens: int = 64,
        log_every: int = 50,
        rank_every: int = 10,
        dist_timeout: float = 60.0,
        display: bool | None = None,
    ) -> Monitor:
        """Start training in a background thread and return at once.

        `step_fn(model, batch)` returns the loss (or a dict with `loss`, `mask`…); the
        runner does backward, clipping, optimizer and scheduler steps. `val_fn(model)`
        runs every `eval_every` steps (eval mode, no grad); so do the attention probe on
        `probe_batch` (default: the first `attention_samples` samples of the first training
        batch) and `sample_fn`. The probe's one forward pass goes through `step_fn` (so
        code inside it runs once more per eval), or through `probe_fn(model, batch)`.
        `dry_run` runs one eval and builds a checkpoint's state before step 1, so a broken
        `val_fn`, probe or scheduler fails the run at once, not at the first eval.
        `resume=True` continues from the newest checkpoint in `run_dir`. `clip` clips the
        global gradient norm from step 1 (as `set_clip` would; it is recorded in the run's
        config). Under torchrun the ranks exchange figures and commands every `rank_every`
        steps; a rank silent for `dist_timeout` s ends the run.
        """
        self._check_can_open(resume)
        if clip is not None:
            self._clip_asked = ctl.check_clip(clip)
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable as step_fn(model, batch), got {step_fn!r}")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
        check_every(eval_every=eval_every, checkpoint_every=checkpoint_every)
        if accumulate < 1:
            raise ValueError(f"accumulate must be at least 1, got {accumulate}")
        if val_fn is not None and eval_every is None:
            eval_every = max(max_steps // 10, 1)
        if not hasattr(train_data, "__iter__"):
            raise TypeError(
                f"train_data must be iterable (a DataLoader, a list of batches…), "
                f"got {type(train_data).__name__}"
            )
        spec = RunSpec(
            step_fn, train_data, max_steps, val_fn=val_fn, eval_every=eval_every,
            sample_fn=sample_fn, accumulate=accumulate, hist_every=hist_every,
            checkpoint_every=checkpoint_every,
            probe_batch=probe_samples(probe_batch, attention_samples),
            probe_fn=probe_fn or self._loop_options.get("probe_fn"), dry_run=dry_run,
            probe_tokens=probe_tokens, attention_samples=attention_samples,
            attention_tokens=attention_tokens, log_every=log_every,
        )
        rec = self._open("start", spec, resume, (rank_every, dist_timeout),
                         {"eval_every": eval_every, "accumulate": accumulate,
                          "hist_every": hist_every})
        self.model.train()
        self._in_thread(Runner(spec, rec).run)
        return self._after_open(display)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Monitor:
        """Run `fn(*args, **kwargs)`, a training loop of your own that calls `log()` once
        per optimizer step, in a background thread; return at once.

        Everything `start()` gives holds: the dashboard, the controls (acting at `log()`),
        `wait()` re-raising the loop's exception, and a stop that ends the loop at its
        next `log()` and records the run as stopped, with a final checkpoint.
        """
        if not callable(fn):
            raise TypeError(f"run() takes your training loop as a function, got {fn!r}")
        self._check_can_open(resume=self._resumed_step is not None)
        spec = RunSpec(**self._loop_options)
        rec = self._open("run", spec, False, self._dist_options, {})
        self._in_thread(lambda: rec.guarded(lambda: fn(*args, **kwargs)))
        return self._after_open(self._display)

    def log(self, loss: Any = None, *, mask: torch.Tensor | None = None, val: Any = None,
            **scalars: Any) -> int:
        """Record the optimizer step just taken; the step boundary of a loop of your own.

        Call it once per optimizer step, after `optimizer.step()` (and `scheduler.step()`).
        `loss`: the step's loss (a scalar tensor or float); `mask`: the batch's
        [batch, seq_len] 0/1 attention mask (padding ratio, sequence lengths, tokens/s);
        `val`: at an eval step, the val loss or a dict of val figures (`loss` →
        `loss/val`, others `val/<name>`); further keywords: scalars recorded as
        `train/<name>`. Gradient figures were taken at the optimizer's step already.
        Queued commands are applied here: pause blocks here until resumed, and a stop
        raises `nbwatch.StopTraining` (after a final checkpoint) to end the loop.
        Returns the step number recorded.
        """
        rec = self._recorder
        if rec is None and self._mode is None and self.scaler is not None:
            rec = self._open_loop()  # the scaler skipped the first optimizer step (overflow)
        if self._mode == "start":
            raise RuntimeError(
                "mon.log() is for a training loop of your own, but this run was started "
                "with mon.start(step_fn, ...), whose runner records every step itself"
            )
        if rec is None:
            if self._mode is None:
                raise RuntimeError(
                    "mon.log() before any optimizer step: call it once per optimizer step, "
                    "after optimizer.step() (nbwatch takes the gradient figures during the "
                    "optimizer's own step); with a GradScaler, whose overflow skips "
                    "optimizer.step(), pass it as nbwatch.Monitor(..., scaler=scaler)")
            raise RuntimeError(f"mon.log(): this run is {self.state} at step {self.step}; "
                               "create a new Monitor (resume=True to continue it)")
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
        host, names, parts, lengths = log_figures(loss, mask, scalars)
        samples = int(mask.shape[0]) if mask is not None and mask.dim() == 2 else None
        step = rec.record_step(host, names, parts, lengths=lengths, samples=samples, val=val,
                               reduction="as computed by the training loop (mon.log)")
        if rec.boundary():
            rec.finish("stopped")
            if self._mode == "loop":
                self._end_loop(None)  # closed now, not at exit: a new run can start
            raise StopTraining(f"run {self.name!r} stopped at step {step}, final checkpoint "
                               "written (mon.run() and `with mon:` end the loop cleanly)")
        return step

    @property
    def stopping(self) -> bool:
        """True once a stop was asked: a loop may check it to clean up and return."""
        rec = self._recorder
        return self._stop_asked or (rec is not None and rec.stopping)

    def close(self) -> None:
        """End a loop run in the foreground (finished, or stopped if a stop was asked),
        with a final checkpoint; `with Monitor(...) as mon:` does this on exit."""
        self._end_loop(None)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> bool:
        if self._mode == "loop":
            self._end_loop(exc)
        elif self._done is not None and exc is None:
            self.wait()
        return isinstance(exc, StopTraining)  # a stop ends the block cleanly

    def _check_can_open(self, resume: bool) -> None:
        if self.running:
            raise RuntimeError(
                f"this Monitor is already {self.state} at step {self.step}; call stop() and "
                "wait() first, or create another Monitor with its own run_dir"
            )
        self._closed.wait()  # the previous run's store and sampler are closed
        if self.rank == 0:
            check_no_writer(self.run_dir)  # before a resume touches the model
        if self._mode is not None and not resume:
            raise RuntimeError(
                f"this Monitor already ran (it is {self.state}); continue from its newest "
                "checkpoint with start(..., resume=True) or nbwatch.Monitor(..., resume=True), "
                "or create a new Monitor with its own run_dir"
            )

    def _open_loop(self, start_step: int | None = None,
                   framework: str | None = None) -> StepRecorder:
        """A loop of the user's own, in the foreground: opened at its first optimizer step
        (or by a framework adapter, at the framework's step `start_step`)."""
        rec = self._open("loop", RunSpec(**self._loop_options), False, self._dist_options,
                         {"framework": framework} if framework else {}, start_step)
        rec.begin()
        self._exc_at_open = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        atexit.register(self._at_exit)
        self._after_open(self._display)
        return rec

    def _open(self, mode: str, spec: RunSpec, resume: bool, dist_options: tuple[int, float],
              run_meta: dict[str, Any], start_step: int | None = None) -> StepRecorder:
        """Open a run: the store, the recorder, the run log and the system sampler.
        `start_step`: where a framework that restored its own checkpoint stands."""
        dist = Dist.detect(*dist_options)  # collective: every rank opens its run
        if start_step is None:
            start_step = self._start_step(resume)
        if self._clip_asked is not None:  # from step 1, and over a resumed checkpoint's
            self.control.clip = self._clip_asked
        rules = self.rules
        if dist is not None:  # decisions that need no exchange must see the same inputs
            rules = [replace(r, params={**r.params, "keys": ("grad_norm/global",)})
                     if r.name == "nonfinite" else r for r in rules]
            if dist.rank != 0:
                rules = [r for r in rules if r.name in SAME_ON_EVERY_RANK]
        self._progress = Progress(step=start_step, state="starting")
        self._progress_start = start_step
        self._stop_asked = False
        self._closed.clear()
        try:
            if dist is not None and dist.rank != 0:
                store = self._store = NullStore(self.run_dir)
            else:
                store = self._open_store(start_step, spec.max_steps, {
                    **run_meta, "mode": mode, "world_size": dist.world if dist else 1,
                    "backend": dist.backend if dist else None})
            rec = StepRecorder(
                spec, self.model, self.optimizer, self.scheduler, self.scaler, store,
                self.checkpointer, self._commands, self.control, self._progress, start_step,
                AlertEngine(rules), self.on_alert, dist,
            )
            self._recorder, self._mode = rec, mode
            self._global_hook = register_optimizer_step_pre_hook(self._foreign_hook)
            if self.rank == 0:
                self._log_handler = open_run_log(rec.log, self.run_dir)
                self._sampler = SystemSampler(self._record_system,
                                              self.system_interval).start()
            if dist is not None and self.rank == 0:
                self._record_sigterm(store)
        except BaseException:  # nothing opened may outlive a start that failed
            self._close_run()
            raise
        return rec

    def _in_thread(self, target: Callable[[], Any]) -> None:
        release_caller_pool()
        self._done = threading.Event()
        self._thread = run_in_thread(target, f"nbwatch-train-{self.name}", self._done)
        # Closes the sampler and the store when training ends, even if nobody calls wait().
        self._finalizer = threading.Thread(target=self._finish, args=(self._done,),
                                           name="nbwatch-finish", daemon=True)
        self._finalizer.start()
        atexit.register(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        """The interpreter is exiting while the run trains (a script that did not wait()):
        stop it as the Stop button does — a stop checkpoint, state `stopped` — and say so,
        rather than let the process abort under a running thread."""
        done, thread = self._done, self._thread
        if done is None or done.is_set():
            return
        with contextlib.suppress(RuntimeError):  # it ended a moment ago
            self._send("stop", source="exit")
        done.wait(300)
        for t in (thread, self._finalizer):
            if t is not None:
                t.join(60)
        print(f"nbwatch: the program exited while run {self.name!r} was training; it was "
              f"stopped at step {self.step} ({self.state}), with a checkpoint, in "
              f"{self.run_dir}. Call mon.wait() to let a run finish.", file=sys.stderr)

    def _after_open(self, display: bool | None) -> Monitor:
        if self.rank != 0:
            return self
        remember(self)  # `%nbwatch` shows the newest run
        if display is None:
            display = _in_notebook()
        if display:
            self.show()
        return self

    def _start_step(self, resume: bool) -> int:
        if self._resumed_step is not None:  # restored when the Monitor was created
            step, self._resumed_step = self._resumed_step, None
            return step
        if resume:
            return self._restore_latest()
        if self.rank == 0 and is_run_dir(self.run_dir) and Run(self.run_dir).step > 0:
            raise FileExistsError(
                f"run_dir {self.run_dir} already holds a run at step {Run(self.run_dir).step}; "
                "pass resume=True to continue it, or choose a new run_dir"
            )
        return 0

    def _restore_latest(self) -> int:
        latest = self.checkpointer.latest()
        if latest is None:
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
        if self._global_hook is not None:
            self._global_hook.remove()
            self._global_hook = None
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
        try:
            clean_exit = isinstance(exc, SystemExit) and exc.code in (0, None)
            if rec.ended:  # stopped at log(), or failed already
                pass
            elif exc is None or isinstance(exc, StopTraining) or clean_exit:
                rec.apply_commands(block=False)  # a stop the loop saw before log() took it
                rec.finish("stopped" if rec.stopping else "finished")
            elif isinstance(exc, KeyboardInterrupt):
                rec.finish("stopped")  # the user's Ctrl-C: a stop, not a crash
            else:
                rec.fail(exc)
            rec.store.flush()
        except RuntimeError as e:  # a dead store: the loop's own exception matters more
            log.error("closing the run store of %s failed: %s", self.name, e)
        finally:
            self._close_run()

    def _at_exit(self) -> None:
        """A script's loop that ended without `with`/close(): record how the process ended."""
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if exc is self._exc_at_open:  # e.g. an earlier notebook cell's error: not this loop's
            exc = None
        with contextlib.suppress(Exception):
            self._end_loop(exc)

    def _record_sigterm(self, store: RunStore) -> None:
        """torchrun ends the survivors with SIGTERM when a rank dies, sometimes before the
        lost connection reaches the training thread: record the failure, then die as asked."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            if self.running and self._progress.error is None:
                self._progress.state = "failed"
                with contextlib.suppress(Exception):
                    store.put(Event(self.step, "error", "critical",
                                    f"[rank 0] terminated by SIGTERM at step {self.step}: "
                                    "the launcher stops the job when a rank fails", {}))
                    store.set_meta("state", "failed")
            elif self._progress.error is not None:  # the training thread is recording it
                self._progress.failure_recorded.wait(20)  # torchrun kills after 30 s
            with contextlib.suppress(Exception):
                store.flush(timeout=5)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _open_store(self, start_step: int, max_steps: int | None,
                    run: dict[str, Any]) -> RunStore:
        self._store = None
        self._store = store = RunStore(self.run_dir)
        if start_step:
            store.truncate_after(start_step)
        nvml, handles = open_nvml()
        names = gpu_names(nvml, handles)
        close_nvml(nvml)
        store.set_meta("name", self.name)
        config = dict(self.config)
        if self.control.clip is not None:  # a setting of the run: compare() shows it
            config.setdefault("clip", self.control.clip)
        store.set_meta("config", config)
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
        try:
            model = plain(self.model)
            state = ckpt["model"]
            if any(k.startswith("_orig_mod.") for k in state):  # saved before this fix
                state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
            model.load_state_dict(state)
            self.optimizer.load_state_dict(ckpt["optimizer"])
            if (self.scheduler is not None and ckpt.get("scheduler") is not None
                    and hasattr(self.scheduler, "load_state_dict")):
                self.scheduler.load_state_dict(ckpt["scheduler"])
            if self.scaler is not None and ckpt.get("scaler") is not None:
                self.scaler.load_state_dict(ckpt["scaler"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise RuntimeError(
                f"checkpoint at step {ckpt.get('step')} in {self.checkpointer.dir} does not fit "
                f"this model/optimizer ({e}); resume with the same model and optimizer setup"
            ) from e
        set_rng_state(ckpt["rng"])
        c = ckpt.get("controls", {})
        self.control.clip = c.get("clip")
        self.control.lr_factor = float(c.get("lr_factor", 1.0))
        self.control.lr_raw = bool(c.get("lr_raw", False))
        return int(ckpt["step"])

    def _record_system(self, figures: dict[str, float]) -> None:
        if self._store is not None:
            self._store.put(Scalars(self._progress.step, figures))

    def wait(self, timeout: float | None = None) -> Monitor:
        """Block until training ends; re-raise the exception that ended it, if any.

        In a notebook this blocks the cell, and widget clicks wait until it returns.
        Ctrl-C ("Interrupt kernel") ends the wait, not the run.
        """
        if self._done is None:
            raise RuntimeError("wait() before start() or run(): nothing runs in the background")
        deadline = None if timeout is None else time.monotonic() + timeout
        # Event.wait, not Thread.join: an interrupted join can mark a live thread stopped
        while not self._done.wait(0.1 if deadline is None
                                  else max(0.0, min(0.1, deadline - time.monotonic()))):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"training still running at step {self.step} after {timeout}s")
        # The thread has finished its work: join it so that nothing of it runs while the
        # interpreter shuts down (torch aborts a process whose thread outlives it).
        for t in (self._thread, self._finalizer):
            if t is not None:
                t.join()
        if self._progress.error is not None:
            raise self._progress.error
        return self

    # -- controls (applied by the recorder between steps) ----------------------------------
    def set_clip(self, max_norm: float | None) -> None:
        """Clip the global gradient norm to `max_norm` from the next step (None: no
        clipping). Before the run starts, it applies from step 1."""
        if not self.running and self._mode is None:
            self._clip_asked = ctl.check_clip(max_norm)
            self.control.clip = self._clip_asked
            return
        super().set_clip(max_norm)

    def _send(self, kind: str, value: float | None = None, source: str = "api") -> None:
        if not self.running:
            raise RuntimeError(f"cannot {kind}: the run is {self.state}, not running")
        if kind == "stop":
            self._stop_asked = True
        self._commands.put(Command(kind, value, source))

    # -- what the caller reads ----------------------------------------------------------
    @property
    def step(self) -> int:
        """Steps completed so far."""
        return self._progress.step

    @property
    def state(self) -> str:
        """'created', 'running', 'paused', 'stopped', 'finished' or 'failed'."""
        return self._progress.state

    @property
    def running(self) -> bool:
        """The run is open and neither ended nor failed (paused counts as running)."""
        return self._recorder is not None and self._progress.state in _LIVE

    @property
    def error(self) -> BaseException | None:
        return self._progress.error

    @property
    def traceback(self) -> str | None:
        return self._progress.traceback

    def _run(self) -> Run | None:
        if self._store is not None:
            with contextlib.suppress(RuntimeError):  # a failed writer: read what it committed
                self._store.flush()
        return Run(self.run_dir) if (self.run_dir / DB_NAME).is_file() else None

    def diagnose(self) -> list:
        """Findings that explain the run so far (val periodicity, step-time bottleneck…)."""
        from .diagnostics import diagnose

        return diagnose(self.df)

    def preflight(self, step_fn: Callable[[nn.Module, Any], Any], data: Iterable,
                  steps: int = 200, **start_kw: Any) -> Any:
        """Run a short trial on this model and restore it; returns checks with `.ok`."""
        from .preflight import preflight

        if self.running:
            raise RuntimeError("preflight() while the run is training; call it before start()")
        return preflight(self, step_fn, data, steps, **start_kw)

    def show(self) -> Any:
        """Display the live dashboard of this run in the notebook."""
        from IPython.display import display

        from .widget import Dashboard

        dash = Dashboard.for_monitor(self)
        display(dash)
        return dash

    def __repr__(self) -> str:
        return f"<nbwatch.Monitor {self.name!r} {self.state} at step {self.step} in {self.run_dir}>"


_in_notebook = in_notebook  # the name older code imports
