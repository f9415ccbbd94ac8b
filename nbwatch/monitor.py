"""`Monitor`: wires a model, optimizer and step function to the runner thread, the store
and (in a notebook) the dashboard; its control methods are what the buttons call."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from . import controls as ctl
from ._omp import release_caller_pool
from .alerts import AlertEngine, configure, default_rules
from .checkpoint import Checkpointer, load, set_rng_state
from .distributed import Dist, NullStore
from .environment import environment
from .logs import open_run_log
from .probes.system import SystemSampler, gpu_names, open_nvml
from .records import Command, Event, Scalars
from .run import Run
from .runner import SAME_ON_EVERY_RANK, Progress, Runner, RunSpec, run_in_thread
from .store import DB_NAME, RunStore, is_run_dir

log = logging.getLogger("nbwatch")
_ALLOWED_FOREIGN = {".ipynb_checkpoints", ".DS_Store", "torchrun.log"}  # launch() writes the log


def _default_run_dir() -> Path:
    """`NBWATCH_RUN_DIR` (set by `nbwatch.launch`), else runs/<date-time>."""
    env = os.environ.get("NBWATCH_RUN_DIR")
    return Path(env) if env else Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def check_run_dir(run_dir: Path) -> None:
    """Refuse a folder that cannot be written or that holds another tool's files."""
    if run_dir.exists() and not run_dir.is_dir():
        raise NotADirectoryError(f"run_dir {run_dir} is a file; pass a folder path")
    if run_dir.is_dir() and not is_run_dir(run_dir):
        foreign = sorted(p.name for p in run_dir.iterdir() if p.name not in _ALLOWED_FOREIGN)
        if foreign:
            shown = ", ".join(foreign[:5]) + (" …" if len(foreign) > 5 else "")
            raise FileExistsError(
                f"run_dir {run_dir} already holds files that nbwatch did not write ({shown}); "
                "pass a new or empty folder so that nothing of yours is mixed up or overwritten"
            )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".nbwatch-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PermissionError(
            f"run_dir {run_dir} is not writable ({e.strerror or e}); pass a folder you can "
            "write to, e.g. run_dir='runs/exp1' under your home or project"
        ) from e


class Monitor(ctl.Controls):
    """Train in a background thread while every step is measured into `run_dir`.

    >>> mon = nbwatch.Monitor(model, optimizer, scheduler, run_dir="runs/exp1",
    ...                       config={"lr": 3e-4})
    >>> mon.start(step_fn, loader, max_steps=2000, val_fn=val_fn, eval_every=200)
    >>> mon.pause(); mon.scale_lr(0.5); mon.resume()
    >>> mon.wait()          # blocks: in a notebook this also blocks the buttons
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
        alerts: dict[str, Any] | None = None,
        on_alert: Callable[[Any], Any] | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                "the model has no parameters that require grad, so there is nothing to train; "
                "unfreeze some (p.requires_grad_(True)) before creating the Monitor"
            )
        if scheduler is not None:
            if getattr(scheduler, "optimizer", optimizer) is not optimizer:
                raise ValueError(
                    "the scheduler was built on another optimizer than the one passed to the "
                    "Monitor; build it on this optimizer: Scheduler(optimizer, ...)"
                )
            if not callable(getattr(scheduler, "step", None)):
                raise TypeError("scheduler must have a step() method (a torch LR scheduler)")
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise TypeError(
                    "ReduceLROnPlateau needs a metric at each step; call scheduler.step(val) "
                    "in your val_fn and pass scheduler=None to the Monitor"
                )
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        self.run_dir = Path(run_dir) if run_dir is not None else _default_run_dir()
        self.rank = _rank()
        if self.rank == 0:  # under torchrun, rank 0 alone writes the run folder
            check_run_dir(self.run_dir)
        self.name = name or self.run_dir.name
        self.config = dict(config or {})
        self.system_interval = system_interval
        self.rules = configure(default_rules(), alerts)  # validates the overrides now
        self.on_alert = on_alert
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep_last)
        self.control = ctl.ControlState()
        self._commands = ctl.CommandQueue()
        self._progress = Progress()
        self._store: RunStore | None = None
        self._thread: threading.Thread | None = None
        self._sampler: SystemSampler | None = None
        self._log_handler: logging.Handler | None = None
        self._spec: RunSpec | None = None
        self._finalizer: threading.Thread | None = None

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
        hist_every: int = 50,
        checkpoint_every: int | None = None,
        probe_batch: Any = None,
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
        `probe_batch` (passed to `step_fn`; default: the first `attention_samples` samples
        of the first training batch) and `sample_fn`. `resume=True` continues from
        the newest checkpoint in `run_dir`. Under torchrun the ranks exchange figures and
        commands every `rank_every` steps; a rank silent for `dist_timeout` s ends the run.
        """
        if self.running:
            raise RuntimeError(
                f"this Monitor is already {self.state} at step {self.step}; call stop() and "
                "wait() first, or create another Monitor with its own run_dir"
            )
        if self._finalizer is not None:
            self._finalizer.join()  # the previous run's store and sampler are closed
        if self._thread is not None and not resume:
            raise RuntimeError(
                f"this Monitor already ran (it is {self.state}); pass resume=True to continue "
                "from its newest checkpoint, or create a new Monitor"
            )
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable as step_fn(model, batch), got {step_fn!r}")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
        for label, v in (("eval_every", eval_every), ("checkpoint_every", checkpoint_every)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{label} must be a positive int or None, got {v!r}")
        if accumulate < 1:
            raise ValueError(f"accumulate must be at least 1, got {accumulate}")
        if val_fn is not None and eval_every is None:
            eval_every = max(max_steps // 10, 1)
        if not hasattr(train_data, "__iter__"):
            raise TypeError(
                f"train_data must be iterable (a DataLoader, a list of batches…), "
                f"got {type(train_data).__name__}"
            )
        if probe_batch is not None:  # else the runner keeps samples of the first batch
            from .probes.attention import take_samples

            probe_batch = take_samples(probe_batch, attention_samples)

        dist = Dist.detect(rank_every, dist_timeout)  # collective: every rank calls start()
        start_step = 0
        ckpt = None
        if resume:
            latest = self.checkpointer.latest()
            if latest is None:
                raise FileNotFoundError(
                    f"resume=True but {self.checkpointer.dir} holds no checkpoint; start "
                    "without resume, or pass the run_dir of the run to continue"
                )
            ckpt = load(latest)
        elif self.rank == 0 and is_run_dir(self.run_dir) and Run(self.run_dir).step > 0:
            raise FileExistsError(
                f"run_dir {self.run_dir} already holds a run at step {Run(self.run_dir).step}; "
                "pass resume=True to continue it, or choose a new run_dir"
            )
        if ckpt is not None:
            start_step = self._restore(ckpt)

        self._spec = RunSpec(
            step_fn, train_data, max_steps, val_fn=val_fn, eval_every=eval_every,
            sample_fn=sample_fn, accumulate=accumulate, hist_every=hist_every,
            checkpoint_every=checkpoint_every, probe_batch=probe_batch,
            probe_tokens=probe_tokens, attention_samples=attention_samples,
            attention_tokens=attention_tokens, log_every=log_every,
        )
        rules = self.rules
        if dist is not None:  # decisions that need no exchange must see the same inputs
            rules = [replace(r, params={**r.params, "keys": ("grad_norm/global",)})
                     if r.name == "nonfinite" else r for r in rules]
            if dist.rank != 0:
                rules = [r for r in rules if r.name in SAME_ON_EVERY_RANK]
        if dist is not None and dist.rank != 0:
            store = self._store = NullStore(self.run_dir)
        else:
            store = self._open_store(start_step, ckpt is not None, max_steps, {
                "eval_every": eval_every, "accumulate": accumulate, "hist_every": hist_every,
                "world_size": dist.world if dist else 1,
                "backend": dist.backend if dist else None})
        self._progress = Progress(step=start_step, state="starting")
        runner = Runner(
            self._spec, self.model, self.optimizer, self.scheduler, self.scaler, store,
            self.checkpointer, self._commands, self.control, self._progress, start_step,
            AlertEngine(rules), self.on_alert, dist,
        )
        if self.rank == 0:
            self._log_handler = open_run_log(runner.log, self.run_dir)
            self._sampler = SystemSampler(self._record_system, self.system_interval).start()
        release_caller_pool()
        self.model.train()
        self._thread = run_in_thread(runner, f"nbwatch-train-{self.name}")
        # Closes the sampler and the store when training ends, even if nobody calls wait().
        self._finalizer = threading.Thread(
            target=self._finish, name="nbwatch-finish", daemon=True,
            args=(self._thread, self._sampler if self.rank == 0 else None, store, runner.log,
                  self._log_handler if self.rank == 0 else None),
        )
        self._finalizer.start()
        if dist is not None and self.rank == 0:
            self._record_sigterm(store)
        if self.rank != 0:
            return self
        from .magic import remember

        remember(self)  # `%nbwatch` shows the newest run
        if display is None:
            display = _in_notebook()
        if display:
            self.show()
        return self

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
                    store.flush(timeout=5)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _open_store(self, start_step: int, resumed: bool, max_steps: int,
                    run: dict[str, Any]) -> RunStore:
        self._store = store = RunStore(self.run_dir)
        if resumed:
            store.truncate_after(start_step)
        nvml, handles = open_nvml()
        store.set_meta("name", self.name)
        store.set_meta("config", self.config)
        store.set_meta("environment", environment(gpu_names(nvml, handles)))
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
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            if self.scheduler is not None and ckpt.get("scheduler") is not None:
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
        return int(ckpt["step"])

    def _record_system(self, figures: dict[str, float]) -> None:
        if self._store is not None:
            self._store.put(Scalars(self._progress.step, figures))

    @staticmethod
    def _finish(thread: threading.Thread, sampler: SystemSampler | None,
                store: Any, logger: logging.Logger, handler: logging.Handler | None) -> None:
        """Close what one run opened, once its training thread has ended."""
        thread.join()
        try:
            if sampler is not None:
                sampler.stop()
            store.close()
        finally:
            if handler is not None:
                logger.removeHandler(handler)
                handler.close()

    def wait(self, timeout: float | None = None) -> Monitor:
        """Block until training ends; re-raise the exception that ended it, if any.

        In a notebook this blocks the cell, and widget clicks wait until it returns.
        """
        if self._thread is None:
            raise RuntimeError("wait() before start(): nothing is running")
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"training still running at step {self.step} after {timeout}s")
        if self._finalizer is not None:
            self._finalizer.join()
        if self._progress.error is not None:
            raise self._progress.error
        return self

    # -- controls (applied by the runner between steps) ------------------------------------
    def _send(self, kind: str, value: float | None = None, source: str = "api") -> None:
        if not self.running:
            raise RuntimeError(f"cannot {kind}: the run is {self.state}, not running")
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
        return self._thread is not None and self._thread.is_alive()

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

    @property
    def df(self) -> pd.DataFrame:
        """One row per step (index `step`), one column per scalar."""
        run = self._run()
        return run.df if run is not None else pd.DataFrame(index=pd.Index([], name="step"))

    @property
    def events(self) -> pd.DataFrame:
        """Alerts, actions, checkpoints and state changes: step, kind, severity, message."""
        run = self._run()
        if run is None:
            return pd.DataFrame(columns=["step", "wall", "kind", "severity", "message", "data"])
        return run.events

    def export_html(self, path: str | os.PathLike) -> Path:
        """Write this run (so far) as one self-contained HTML file; returns its path."""
        from .export import export_html

        self._run()  # commits what is queued
        return export_html(self.run_dir, path)

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


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"
