"""`Monitor`: wires a model and optimizer to the step recorder, the store and (in a
notebook) the dashboard; its control methods are what the buttons call.

Three ways to drive it, one recorder underneath: `start(step_fn, data)` (nbwatch runs the
loop), `run(train)` (the user's loop, with `log()` once per optimizer step, in a
background thread), or the user's loop in the foreground (`with Monitor(...) as mon:`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import controls as ctl
from ..distributed import NullStore
from ..interrupts import wait_only
from ..lifecycle import RunState
from ..notebook import current_cell, in_notebook, started_here
from ..ownership import own_loop_here, refuse_in_training_thread
from ..recorder import Rewound, StopTraining
from ..records import Command
from ..run import Readout, Run, started_run
from ..runner import Runner
from ..store import RunStore
from .background import TrainingThread
from .exiting import ProcessExit, raise_if_terminated
from .given import Given
from .inputs import check_closure_free, check_start
from .options import NOT_GIVEN, Options, check_every, check_peak_flops, probe_samples
from .own_loop import log_step
from .port import ExternalLoop
from .session import RunSession
from .setup import Setup

log = logging.getLogger("nbwatch")


class Monitor(ctl.Controls, Given, Readout):
    """Train in a background thread while every step is measured into `run_dir`.

    >>> mon = nbwatch.Monitor(model, optimizer, scheduler, run_dir="runs/exp1", config=args)
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

    The keyword arguments from `resume` on set the run's options for every loop (`start()`
    takes its own `resume` and `max_steps`, and overrides those it is given): `resume=True`
    loads the newest checkpoint of `run_dir` now (`mon.step` says where the loop stands);
    `probe_batch` (+ `probe_fn(model, batch)`) gives the attention probe its fixed samples,
    run at each `log(val=...)` and, with `probe_every=N`, every N steps without a val
    (nothing recorded as `loss/val`); `checkpoint_every` steps. `peak_flops`: the device's
    peak FLOP/s for MFU, where `probes.throughput.PEAK_FLOPS` lacks its name. `config`: a
    dict, an argparse Namespace, a dataclass or an OmegaConf one.
    `update_every`: the update ratios ‖ΔW‖/‖W‖ per layer every N steps (default: with the
    histograms, every `hist_every`); `update_every=1` takes them every step, at the cost of
    a copy of the weights before each update.
    `baseline="runs/exp0"` (or a list of run folders): earlier runs whose train/val loss
    and LR the dashboard and the export draw faded under this run's, config diff on hover.
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
        probe_every: int | None = None,
        attention_samples: int = 2,
        attention_tokens: int = 64,
        hist_every: int = 50,
        update_every: int | None = None,
        checkpoint_every: int | None = None,
        log_every: int = 50,
        rank_every: int = 10,
        dist_timeout: float = 60.0,
        display: bool | None = None,
        peak_flops: float | None = None,
        baseline: str | os.PathLike | list[str | os.PathLike] | None = None,
    ):
        check_every(max_steps=max_steps, checkpoint_every=checkpoint_every,
                    update_every=update_every, probe_every=probe_every)
        self._setup = setup = Setup.of(
            model, optimizer, scheduler, run_dir, config, scaler=scaler, name=name,
            keep_last=keep_last, system_interval=system_interval, alerts=alerts,
            on_alert=on_alert, baseline=baseline)
        # one home for the run's options: start() overrides them one by one
        options = Options(
            max_steps=max_steps, hist_every=hist_every, update_every=update_every,
            checkpoint_every=checkpoint_every, log_every=log_every, clip=clip,
            probe_batch=probe_samples(probe_batch, attention_samples), probe_fn=probe_fn,
            probe_tokens=probe_tokens, probe_every=probe_every,
            attention_samples=attention_samples,
            attention_tokens=attention_tokens, rank_every=rank_every,
            dist_timeout=dist_timeout, display=display,
            peak_flops=check_peak_flops(peak_flops))
        self._session = session = RunSession(setup, options, on_loop_open=self._loop_opened,
                                             on_distributed=self._distributed_opened)
        if clip is not None:  # wins over a resumed checkpoint's
            session.clip_asked = ctl.check_clip(clip)
        self._thread = TrainingThread()
        self._exit = ProcessExit(session, self._thread, self.send)
        self.rewound: Rewound | None = None  # set by log() after a rewind (own loop)
        self.skip_batches = 0  # set by log(): batches the own loop is asked to skip now
        if resume:
            session.resume_now()

    @property
    def run_dir(self) -> Path:  # type: ignore[override]
        return self._setup.run_dir

    # -- lifecycle ----------------------------------------------------------------------
    def start(
        self,
        step_fn: Callable[[nn.Module, Any], Any],
        train_data: Iterable,
        max_steps: int,
        val_fn: Callable[[nn.Module], Any] | None = None,
        eval_every: int | None = None,
        sample_fn: Callable[[nn.Module], Any] | None = None,
        resume: bool = False,
        *,
        accumulate: int = 1,
        clip: float | None = NOT_GIVEN,
        hist_every: int = NOT_GIVEN,
        update_every: int | None = NOT_GIVEN,
        checkpoint_every: int | None = NOT_GIVEN,
        probe_batch: Any = NOT_GIVEN,
        probe_fn: Callable[[nn.Module, Any], Any] | None = NOT_GIVEN,
        dry_run: bool = True,
        probe_tokens: list[list[str]] | None = NOT_GIVEN,
        attention_samples: int = NOT_GIVEN,
        attention_tokens: int = NOT_GIVEN,
        log_every: int = NOT_GIVEN,
        rank_every: int = NOT_GIVEN,
        dist_timeout: float = NOT_GIVEN,
        display: bool | None = NOT_GIVEN,
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
        config). Under torchrun the ranks meet every `rank_every` steps (or ~2 s of slow
        ones); a rank silent for `dist_timeout` s ends the run.

        The options shared with `Monitor(...)` (`hist_every`, `update_every`,
        `checkpoint_every`, `clip`, the probe's, `log_every`, `rank_every`, `dist_timeout`,
        `display`): given here, they override the Monitor's for this run; left out, the
        Monitor's hold.
        """
        session = self._session
        session.check_can_open(resume)
        check_closure_free(self.optimizer)
        opts = session.options.merged(
            clip=clip, hist_every=hist_every, update_every=update_every,
            checkpoint_every=checkpoint_every, probe_batch=probe_batch, probe_fn=probe_fn,
            probe_tokens=probe_tokens, attention_samples=attention_samples,
            attention_tokens=attention_tokens, log_every=log_every, rank_every=rank_every,
            dist_timeout=dist_timeout, display=display)
        if clip is not NOT_GIVEN:  # None given turns a Monitor's clip off for this run
            session.clip_asked = opts.clip
        max_steps, eval_every, accumulate = check_start(
            step_fn, train_data, max_steps, val_fn, eval_every, opts.checkpoint_every, accumulate)
        spec = replace(
            opts.spec(), step_fn=step_fn, train_data=train_data, max_steps=max_steps,
            val_fn=val_fn, eval_every=eval_every, sample_fn=sample_fn, accumulate=accumulate,
            dry_run=dry_run)
        rec = session.open("start", spec, resume, opts,
                         {"eval_every": eval_every, "accumulate": accumulate,
                          "hist_every": opts.hist_every, "val_fn": val_fn is not None})
        self.model.train()
        self._in_thread(Runner(spec, rec).run)
        return self._shown(opts.display)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Monitor:
        """Run `fn(*args, **kwargs)`, a training loop of your own that calls `log()` once
        per optimizer step, in a background thread; return at once.

        Everything `start()` gives holds: the dashboard, the controls (acting at `log()`),
        `wait()` re-raising the loop's exception, and a stop that ends the loop at its
        next `log()` and records the run as stopped, with a final checkpoint.
        """
        if not callable(fn):
            raise TypeError(f"run() takes your training loop as a function, got {fn!r}")
        session = self._session
        session.check_can_open(resume=session.resumed_step is not None)
        rec = session.open("run", session.options.spec(), False, session.options, {})
        rec.rewind_state.can_rewind = True  # the loop and its steps are the user's
        self._in_thread(lambda: rec.guarded(lambda: fn(*args, **kwargs)))
        return self._shown(session.options.display)

    def log(self, loss: Any = None, *, mask: torch.Tensor | list[torch.Tensor] | None = None,
            val: Any = None, batch: Any = None, logits: torch.Tensor | None = None,
            **scalars: Any) -> int:
        """Record the optimizer step just taken; the step boundary of a loop of your own.

        Call it once per optimizer step, after `optimizer.step()` (and `scheduler.step()`).
        `loss`: the step's loss (a scalar tensor or float), or under gradient accumulation
        each micro-batch's, before dividing by their count (a list: their mean); `mask`:
        the batch's [batch, seq_len] 0/1 attention mask (padding, lengths, tokens/s), or
        one per micro-batch;
        `val`: at an eval step, the val loss or a dict of val figures (`loss` → `loss/val`,
        others `val/<name>`); `batch`: the step's batch, whose identity (`epoch=`, `index=`,
        else a count of the batches given; a CRC-32 of its CPU token ids) `run.spikes`
        names, and a packed batch's `position_ids` its documents (their lengths, count:
        `data/seq_len_*`, samples/s), or one per micro-batch; `logits`: the step's output
        logits [..., vocab] (of its last micro-batch, say), whose mean log-partition and
        largest |logit| over at most 64 positions are recorded as `train_logits/log_z` and
        `train_logits/max_abs` (on the device, no sync of their own; without them, the
        output layer's, from a forward hook set at the first such log()); further keywords:
        scalars recorded as `train/<name>`. Gradient figures were taken at the optimizer's
        step already.
        Queued commands are applied here: pause blocks here until resumed, and a stop
        raises `nbwatch.StopTraining` (after a final checkpoint) to end the loop.
        Returns the step number recorded, or after a rewind the checkpoint's step the
        weights are now at (`mon.rewound` then says it, and how many batches to skip)."""
        logged = log_step(self._session, self._thread.thread, loss, mask, val, batch, logits,
                          scalars, self._end_loop)
        self.rewound, self.skip_batches = logged.rewound, logged.skip_batches
        return logged.step

    @property
    def stopping(self) -> bool:
        """True once a stop was asked: a loop may check it to clean up and return."""
        return self._session.stopping

    def close(self) -> None:
        """End a loop run in the foreground (finished, or stopped if a stop was asked),
        with a final checkpoint; `with Monitor(...) as mon:` does this on exit."""
        self._end_loop(None)

    def __enter__(self) -> Monitor:
        if self._session.mode == "loop" and self._session.recorder is None:  # it ended
            raise RuntimeError(
                f"this Monitor's run is {self.state} at step {self.step}, and a loop of your "
                "own records one run a Monitor: create a new Monitor (with resume=True and "
                "the same run_dir to continue this run)")
        return self

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> bool:
        if self._session.mode == "loop":
            self._end_loop(exc)
        elif self._thread.started and exc is None:
            self.wait()
        return isinstance(exc, StopTraining)  # a stop ends the block cleanly

    # -- how the parts are tied together ------------------------------------------------
    def _in_thread(self, target: Callable[[], Any]) -> None:
        self._thread.start(target, f"nbwatch-train-{self.name}", on_end=self._thread_ended)
        self._exit.arm_thread()

    def _thread_ended(self) -> None:
        """The training thread ended: close what its run opened (in the finisher thread)."""
        self._session.close_run()
        self._exit.disarm_thread()

    def _loop_opened(self) -> None:
        try:
            self._exit.arm_loop()
            self._shown(self._session.options.display)
        except BaseException as e:  # its store is open: the run failed, said there
            self._end_loop(e)
            raise

    def _distributed_opened(self, store: RunStore | NullStore) -> None:
        self._exit.record_sigterm(store)
        rec = self._session.recorder
        if rec is not None:  # a loop of one's own paused in log(): no next log() asks it
            rec.paused_tick = lambda: raise_if_terminated(self._session)

    def _end_loop(self, exc: BaseException | None) -> None:
        """End a foreground loop run: finished, stopped, or failed with `exc`."""
        if self._session.mode == "loop" and self._session.recorder is not None:
            self._exit.disarm_loop()
        self._session.end_loop(exc)

    def _shown(self, display: bool | None) -> Monitor:
        if self._setup.rank != 0:
            return self
        started_here(self)  # `%nbwatch` shows the newest run; a cell run again is told
        if display if display is not None else in_notebook():
            self.show()
        self._shown_in = current_cell()  # as this cell's result: no dashboard (again)
        return self

    def wait(self, timeout: float | None = None) -> Monitor:
        """Block until training ends; re-raise the exception that ended it, if any.

        In a notebook this blocks the cell, and widget clicks wait until it returns.
        Ctrl-C ("Interrupt kernel") ends the wait, not the run (its traceback says so).
        A loop of your own in the foreground has nothing to join: called on its thread
        (between its steps, so after its last), wait() ends its run as close() does,
        stopped if a stop was asked.
        """
        if own_loop_here(self._session):
            self._end_loop(None)  # (once ended, nothing: its recorder is gone)
        else:
            with wait_only(self):
                self._thread.wait(timeout, lambda: self.step)
        progress = self._session.progress
        if progress.error is not None:
            raise progress.error.with_traceback(progress.error_tb)
        return self

    # -- controls (applied by the recorder between steps) ----------------------------------
    def set_clip(self, max_norm: float | None) -> str | None:
        """Clip the global gradient norm to `max_norm` from the next step (None: no
        clipping). Before the run starts, it applies from step 1 (and returns None)."""
        if not self.running and self._session.mode is None:
            self._session.clip_asked = self.control.clip = ctl.check_clip(max_norm)
            return None
        return super().set_clip(max_norm)

    def submit(self, command: Command) -> None:
        """Queue `command` for the next step boundary (refused now if it cannot apply)."""
        self._session.submit(command)

    # -- a loop nbwatch does not run (monitor/port.py) --------------------------------------------
    def open_external(self, framework: str, start_step: int | None = None, *,
                      save: Callable[[str], None] | None = None, clip: float | None = None,
                      measure_in_hook: bool = True,
                      commands: ctl.CommandQueue | None = None) -> ExternalLoop:
        """Open the run of a fit `framework` runs, at its step `start_step` (a resumed
        fit's). `save(reason)` writes a checkpoint the framework's way (None: nbwatch's
        own); `clip`: the framework's own clipping, after nbwatch's; `measure_in_hook`:
        False where the optimizer's pre-hook comes before the gradients are complete (the
        adapter calls `measure()`); `commands`: the queue a handle filled before the fit
        began."""
        if commands is not None:
            self._session.commands = commands
        rec = self._session.open_loop(start_step, framework)
        rec.save_fn, rec.framework_clip, rec.hook_measures = save, clip, measure_in_hook
        return ExternalLoop(rec, self._end_loop, self._session)

    def _left_open(self) -> bool:
        """Asked from outside its loop: a loop of your own in the foreground, on this
        thread, whose run is open though the loop is not running (its cell ended mid-loop:
        an error, Ctrl-C, or no `with`), so nothing trains it."""
        return self.running and own_loop_here(self._session)

    @property
    def closed(self) -> bool:
        """No run is open: the store, the sampler and the folder's writer lock are given back."""
        return self._session.closed.is_set()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until the run's store and sampler are closed; False on a timeout."""
        refuse_in_training_thread("wait_closed()", self._thread.threads)
        return self._session.closed.wait(timeout)

    # -- what the caller reads ----------------------------------------------------------
    @property
    def step(self) -> int:
        """Steps completed so far."""
        return self._session.step

    @property
    def state(self) -> RunState:
        """A `RunState` (compares equal to its name): 'created', 'starting', 'running',
        'paused', 'stopping', 'stopped', 'finished' or 'failed'."""
        return self._session.state

    @property
    def running(self) -> bool:
        """The run is open and neither ended nor failed (paused counts as running)."""
        return self._session.running

    @property
    def error(self) -> BaseException | None:
        return self._session.progress.error

    @property
    def traceback(self) -> str | None:
        return self._session.progress.traceback

    def _run(self) -> Run | None:
        self._session.record_waiting()
        store = self._session.store
        if store is not None:
            with contextlib.suppress(RuntimeError):  # a failed writer: read what it committed
                store.flush()
        return started_run(self.run_dir)

    def preflight(self, step_fn: Callable[[nn.Module, Any], Any], data: Iterable,
                  steps: int = 200, **start_kw: Any) -> Any:
        """Run a short trial on this model and restore it; returns checks with `.ok`."""
        from .preflight import preflight

        if self.running:
            raise RuntimeError("preflight() while the run is training; call it before start()")
        return preflight(self, step_fn, data, steps, **start_kw)

    def __repr__(self) -> str:
        return f"<nbwatch.Monitor {self.name!r} {self.state} at step {self.step} in {self.run_dir}>"

