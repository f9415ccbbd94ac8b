"""The step boundary, shared by `Monitor.start()` (the runner's loop) and `Monitor.log()`
(a loop the user keeps): gradient probes at the optimizer's own step, one host copy,
records, alerts and their actions, evals, checkpoints, commands, and the run's end.

Gradient figures come from optimizer step hooks, so both modes measure the same thing at
the same moment, after backward (and a GradScaler's unscale) and before the update:

    optimizer.step()  pre-hook   LR factor on · grad norms · ONE host copy (with the loss
                                 the runner staged, or the previous logged step's) ·
                                 "grads" rules (skip, clip) · clip · weights snapshot
                      (update)
                      post-hook  update ratios · LR factor off, so that the scheduler
                                 steps the plain schedule
    scheduler.step()
    end of the step              LR factor on · the step's record · "step" rules ·
                                 histograms · eval figures · checkpoint · commands
                                 (pause blocks here, stop ends the loop here)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import controls as ctl
from .alerts import AlertEngine, default_rules, weight_std
from .checkpoint import Checkpointer, rng_state
from .distributed import Dist, lost_peer, merge_ranks, rank_figures
from .evaluation import EvalResult, evaluate
from .probes import weights as wprobe
from .probes.grads import Layers, clip_, layer_norms, param_grad_norms
from .probes.throughput import timing_figures
from .records import Command, Event, Histogram, Sample, Scalars
from .store import RunStore

log = logging.getLogger("nbwatch.recorder")
# Rules whose inputs are identical on every DDP rank (the synchronised gradients): each
# rank reaches the same decision at the same step without asking the others.
SAME_ON_EVERY_RANK = ("nonfinite", "grad_explosion")
_FROM_ALL_RANKS = ("loss/train", "tokens/real", "throughput/tokens_per_s")
_RUN_IDS = itertools.count(1)  # each run's logger is its own, whatever its folder's name


class StopTraining(BaseException):  # noqa: N818 - reads as what it does, like SystemExit
    """Raised by `Monitor.log()` once the run was stopped: it ends a loop that ignores
    log's return value. `Monitor.run()` and `with Monitor(...)` take it as a clean stop.

    A BaseException, so that a loop's `except Exception:` does not swallow it.
    """

    def _render_traceback_(self) -> list[str]:  # IPython: one line, not a traceback
        return [f"nbwatch: {self}"]


@dataclass
class RunSpec:
    """What a run records and when; `step_fn`/`train_data`/`max_steps` drive `start()`."""

    step_fn: Callable[[nn.Module, Any], Any] | None = None
    train_data: Iterable | None = None
    max_steps: int | None = None
    val_fn: Callable[[nn.Module], Any] | None = None
    eval_every: int | None = None
    sample_fn: Callable[[nn.Module], str] | None = None
    accumulate: int = 1
    hist_every: int = 50
    hist_bins: int = 64
    checkpoint_every: int | None = None
    probe_batch: Any = None
    probe_fn: Callable[[nn.Module, Any], Any] | None = None
    probe_tokens: list[list[str]] | None = None
    attention_samples: int = 2  # 0: no attention probe
    attention_tokens: int = 64
    log_every: int = 50
    trial: bool = False  # preflight: no checkpoints, no pausing
    dry_run: bool = True  # start(): an eval and a checkpoint's state before step 1


SMOOTHING = 0.9  # panels/loss.py smooth()'s weight: the gap is measured on the drawn curve


@dataclass
class Progress:
    """State shared with the caller's thread: read freely, written only by the recorder."""

    step: int = 0
    state: str = "created"
    error: BaseException | None = None
    traceback: str | None = None
    # the train loss smoothed as the dashboard draws it (debiased EMA, weight 0.9): loss/gap
    train_ema: float = 0.0
    train_ema_n: int = 0
    # set when a failure is fully recorded (error, state, emergency checkpoint)
    failure_recorded: threading.Event = field(default_factory=threading.Event)

    def train_smooth(self) -> float | None:
        """The smoothed train loss at this step: the curve's value where val is drawn."""
        n = self.train_ema_n
        return self.train_ema / (1 - SMOOTHING**n) if n else None


@dataclass
class _Taking:
    """The optimizer step being taken: what its pre-hook measured and decided."""

    step: int
    values: dict[str, float]
    alerts: list
    skip: bool
    before: list | None  # weights snapshot on histogram steps
    t_pre: float
    t_probe: float
    t_post: float = 0.0
    explicit: bool = False  # measured by a framework adapter, not the optimizer's hook


@dataclass
class _Deferred:
    """Device figures of a step, copied to the host with the next gradient copy."""

    step: int
    names: list[str]
    parts: list[torch.Tensor]
    values: dict[str, float]  # host figures of that step, completed by the copy
    alerts: list


class StepRecorder:
    """Measures and records each optimizer step of one run, and steers it between steps."""

    def __init__(
        self,
        spec: RunSpec,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: Any,
        store: RunStore,
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
        self.progress = progress
        self.engine = engine if engine is not None else AlertEngine(default_rules())
        self.on_alert = on_alert
        self.dist = dist
        self.step = self._start_step = start_step
        self.layers = Layers.of(model)
        self._grad_names = ["grad_norm/global"] + [f"grad_norm/{n}" for n in self.layers.names]
        self.stopping = False
        self.ended = False
        self.log = logging.getLogger(f"nbwatch.run.{store.run_dir.name}.{next(_RUN_IDS)}")
        self._skip_nonfinite = any(r.name == "nonfinite" and "skip_step" in r.actions
                                   for r in self.engine.rules)
        self._rank_rows: list[tuple[int, dict[str, float]]] = []
        self._sync_s = 0.0
        self._rank_step_times: dict[int, deque[float]] = {}
        self._last_val: float | None = None
        self._seq_lens: list[torch.Tensor] = []
        self._store_poll = 0.0
        self._command_id = 0  # the newest store command taken
        self._reduction_saved = False
        self._ckpt_step: int | None = None
        self._taking: _Taking | None = None  # set by the pre-hook, consumed at the step's end
        self._stepped = False  # the optimizer stepped since the last end of step
        self._staged: tuple[list[str], list[torch.Tensor]] | None = None  # the runner's loss
        self._deferred: _Deferred | None = None
        self._sched_count: Any = None  # the scheduler's step count at the last post-hook
        self._sched_at_end: Any = None  # … and at the last end of step
        self._scale_ref: torch.Tensor | None = None  # the GradScaler's scale at that end
        self._t_boundary = time.perf_counter()
        # Set by framework adapters: False when the optimizer's pre-hook comes too early to
        # see the gradients (Lightning's closure runs backward inside optimizer.step), and
        # the adapter calls `pre_step()` itself at the framework's own moment.
        self.hook_measures = True
        # Set by framework adapters: checkpoints the framework's way; None: nbwatch's own.
        self.save_fn: Callable[[str], None] | None = None
        # Set by framework adapters: the framework's own clipping (Trainer max_grad_norm,
        # Lightning gradient_clip_val), after nbwatch's; `grad_norm/clipped` shows both.
        self.framework_clip: float | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def begin(self) -> None:
        self._set_state("running")
        self._t_boundary = time.perf_counter()

    def guarded(self, body: Callable[[], Any]) -> None:
        """Run `body` (the training loop) as this run: a clean return ends it finished (or
        stopped, if a stop was asked), `StopTraining` stopped, any other exception failed
        with its traceback and an emergency checkpoint. Never raises."""
        try:
            self.begin()
            body()
            self.apply_commands(block=False)  # a stop the loop saw before log() took it
            self.finish("stopped" if self.stopping else "finished")
        except StopTraining:
            self.finish("stopped")
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
        self.flush_deferred()
        if self.dist is not None:
            self._sync_ranks(final=True)
        self._checkpoint("stop" if outcome == "stopped" else "final")
        self._set_state(outcome)
        self.ended = True

    def fail(self, e: BaseException) -> None:
        """Record `e` as the end of the run, with an emergency checkpoint."""
        p = self.progress
        p.error = e
        p.traceback = "".join(traceback.format_exception(e))
        p.state = "failed"  # first: recording it below may itself fail (a dead store)
        self.ended = True
        msg = f"{type(e).__name__}: {e}"
        if self.dist is not None:
            if lost_peer(e):
                msg = ("lost contact with another rank (it died or hangs), so this rank "
                       f"stops: {str(e).splitlines()[0][:300]}")
            msg = f"[rank {self.dist.rank}/{self.dist.world}] {msg}"
        # each part on its own: a dead store must not cost the checkpoint, nor the reverse
        # the error and the state first: the launcher may kill this process any moment now
        for record in (self.flush_deferred,
                       lambda: self._emit(Event(self.step, "error", "critical", msg,
                                                {"traceback": p.traceback}), logging.ERROR),
                       lambda: self._set_state("failed"),
                       lambda: self._checkpoint("emergency")):
            try:
                record()
            except BaseException as ce:  # noqa: BLE001 - the original error matters more
                self.log.error("recording the failure failed too: %s\n%s", ce, p.traceback)
        with contextlib.suppress(Exception):
            self.store.flush(timeout=30)
        p.failure_recorded.set()

    def _set_state(self, state: str) -> None:
        self.progress.state = state
        self.store.set_meta("state", state)
        self.store.set_meta("step", self.step)
        if state != "running" or self.step:
            self._emit(Event(self.step, "state", "info", f"run {state} at step {self.step}",
                             {"state": state}))

    def _emit(self, ev: Event, level: int | None = None) -> None:
        self.store.put(ev)
        lvl = level if level is not None else {
            "info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL
        }[ev.severity]
        self.log.log(lvl, ev.message, extra={"step": ev.step, "kind": ev.kind, "data": ev.data})

    # -- commands (between steps only) --------------------------------------------------
    def _poll_commands(self) -> list[Command]:
        cmds = self.commands.drain()
        now = time.monotonic()
        if now - self._store_poll > 0.25:  # other processes write commands into the store
            self._store_poll = now
            for cid, cmd in self.store.pending_commands(self._command_id):
                self.store.mark_taken(cid)
                self._command_id = cid
                cmds.append(cmd)
        return cmds

    def apply_commands(self, block: bool = True) -> None:
        """Apply queued commands; while paused (and `block`), wait here for more."""
        if self.dist is not None:
            d = self.dist
            if self.control.paused or (self.step > self._start_step and self.step % d.every == 0):
                self._sync_ranks()
            return
        for cmd in self._poll_commands():
            self._apply(cmd)
        if self.control.paused and block and not self.stopping and not self.spec.trial:
            self.flush_deferred()  # the page shows the step it is paused at
            self.store.flush()
        while self.control.paused and block and not self.stopping and not self.spec.trial:
            cmd = self.commands.get(timeout=0.1)
            for c in ([cmd] if cmd else []) + self._poll_commands():
                self._apply(c)

    def _sync_ranks(self, final: bool = False) -> None:
        """Meet the other ranks: figures to rank 0, rank 0's commands to all, applied here
        at this same step on every rank; while paused, meet again every 0.1 s."""
        d = self.dist
        assert d is not None
        self.flush_deferred()
        while True:
            cmds = self._poll_commands() if d.rank == 0 else []
            t0 = time.perf_counter()
            rows, cmds = d.exchange(self._rank_rows, cmds)
            self._sync_s = time.perf_counter() - t0
            self._rank_rows = []
            if d.rank == 0:
                self._record_ranks(rows)
            for c in cmds:
                self._apply(c)
            if final or not self.control.paused or self.stopping:
                return
            if d.rank == 0:
                time.sleep(0.1)  # the others wait in the next exchange

    def _record_ranks(self, rows: list) -> None:
        for sc in merge_ranks(rows):
            self.store.put(sc)
            for r in range(self.dist.world):
                # busy time outside collectives: a fast rank's step also holds its wait
                # for the slow one (inside backward), so step time alone hides a straggler
                fwd = sc.values.get(f"rank{r}/time/forward")
                data = sc.values.get(f"rank{r}/time/data", 0.0)
                if fwd is not None:
                    self._rank_step_times.setdefault(r, deque(maxlen=50)).append(fwd + data)
        recent = {r: float(np.median(ts)) for r, ts in self._rank_step_times.items()
                  if len(ts) >= 20}
        self._raise_alerts(self.engine.observe("ranks", self.step, None,
                                               rank_step_times=recent))

    def _apply(self, cmd: Command) -> None:
        c, step = self.control, self.step
        if cmd.kind == "pause" and not c.paused:
            c.paused = True
            self._set_state("paused")
            msg = f"paused at step {step}"
        elif cmd.kind == "resume" and c.paused:
            c.paused = False
            self._set_state("running")
            msg = f"resumed at step {step}"
        elif cmd.kind == "stop":
            self.stopping = True
            msg = f"stop requested at step {step}"
        elif cmd.kind == "checkpoint":
            self._checkpoint("manual")
            return
        elif cmd.kind == "clip":
            c.clip = cmd.value
            msg = f"gradient clipping at {cmd.value:g}" if cmd.value else "gradient clipping off"
        elif cmd.kind == "scale_lr":
            before = ctl.lrs(self.opt)[0] * (c.lr_factor if c.lr_raw else 1.0)
            if not c.lr_raw and self._scheduler_pending():
                # the loop steps its scheduler after log(): let it step the plain schedule
                ctl.scale_lrs(self.opt, 1.0 / c.lr_factor)
                c.lr_raw = True
            if not c.lr_raw:  # else the factor goes on when the scheduler has stepped
                ctl.scale_lrs(self.opt, cmd.value)
            c.lr_factor *= cmd.value
            msg = (f"LR scaled ×{cmd.value:g} (factor now {c.lr_factor:g}): "
                   f"{before:.3g} → {before * cmd.value:.3g}")
        else:  # pause while paused, resume while running: nothing to acknowledge
            return
        self._emit(Event(step, "action", "info", msg,
                         {"command": cmd.kind, "value": cmd.value, "source": cmd.source}))

    # -- the LR factor around the user's scheduler ---------------------------------------
    # The factor is divided out after the optimizer step and put back once the scheduler
    # has stepped: closed-form schedules (recomputed from base_lrs) and chainable ones
    # (×gamma of the current LR) both yield factor × schedule, and the scheduler's own
    # object and state_dict stay untouched.
    def _lr_off(self) -> None:
        c = self.control
        if self.sched is not None and c.lr_factor != 1.0 and not c.lr_raw:
            ctl.scale_lrs(self.opt, 1.0 / c.lr_factor)
            c.lr_raw = True

    def _scheduler_pending(self) -> bool:
        """The optimizer stepped but the scheduler has not yet (it steps after log())."""
        if self.sched is None or self._sched_count is None:
            return False
        n = ctl.steps_taken(self.sched)
        return n is not None and n == self._sched_count

    def _lr_on(self, only_if_scheduled: bool = False) -> None:
        c = self.control
        if not c.lr_raw:
            return
        if only_if_scheduled:
            n = ctl.steps_taken(self.sched)
            if n is not None and n == self._sched_count:
                return  # the loop steps its scheduler after log(): the next step puts it on
        ctl.scale_lrs(self.opt, c.lr_factor)
        c.lr_raw = False

    # -- one optimizer step --------------------------------------------------------------
    @property
    def skipping(self) -> bool:
        """The optimizer step just taken was skipped (non-finite figures)."""
        return self._taking is not None and self._taking.skip

    def overflowed(self) -> bool:
        """Whether the GradScaler lowered its scale since the last end of step (it skipped
        the optimizer); True when that cannot be told (its first steps)."""
        scale = getattr(self.scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor) or self._scale_ref is None:
            return True
        return bool((scale < self._scale_ref.to(scale.device)).item())

    @property
    def stepped(self) -> bool:
        """The optimizer stepped since the last end of step."""
        return self._stepped

    def stage(self, names: list[str], parts: list[torch.Tensor]) -> None:
        """Device figures of the step about to be taken (the runner's loss), copied to the
        host together with its gradient norms."""
        self._staged = (names, parts)

    def pre_step(self, explicit: bool = True) -> None:
        """The step's gradient figures, one host copy, the rules that can still skip or
        clip this step, and a weights snapshot on histogram steps. Called by the
        optimizer's pre-hook (`explicit=False`), or by a framework adapter at the moment
        its framework has the gradients but has not clipped them yet."""
        if self._stepped:
            raise RuntimeError(
                "optimizer.step() ran twice without mon.log() in between: call "
                "mon.log(loss=...) once after every optimizer.step()"
            )
        if not explicit and self._taking is not None and self._taking.explicit:
            return  # the adapter measured this step already, before its framework clipped
        t0 = time.perf_counter()
        self._lr_on()
        step = self.step + 1
        lrs = ctl.lrs(self.opt)  # the LR this step uses
        norms, layer_of, grads = param_grad_norms(self.layers)
        dev = self.layers.params[0].device
        names: list[str] = []
        parts: list[torch.Tensor] = []
        deferred, self._deferred = self._deferred, None
        if deferred is not None:  # the previous step's loss: one copy for both steps
            names += deferred.names
            parts += deferred.parts
        if self._staged is not None:  # this step's loss, from the runner
            names += self._staged[0]
            parts += self._staged[1]
            self._staged = None
        # A GradScaler calls a fused optimizer's step even on an overflow, with `found_inf`
        # set, and (unless unscale_ ran) with still-scaled gradients and their scale
        scale = getattr(self.opt, "grad_scale", None)
        found_inf = getattr(self.opt, "found_inf", None)
        if isinstance(scale, torch.Tensor):
            names.append("_grad_scale")
            parts.append(scale.reshape(()).float())
        if isinstance(found_inf, torch.Tensor):
            names.append("_found_inf")
            parts.append(found_inf.reshape(()).float())
        parts += norms
        host = _to_host(parts, dev) if parts else []  # the sync
        k, nd = len(names), len(deferred.names) if deferred is not None else 0
        if deferred is not None:
            deferred.values.update(zip(deferred.names, host[:nd]))
            self._complete(deferred.step, deferred.values, deferred.alerts)
        values = dict(zip(names[nd:], host[nd:k]))
        unscale = 1.0 / values.pop("_grad_scale", 1.0)
        if values.pop("_found_inf", 0.0):  # the fused optimizer skips this step itself
            values.update({"lr": lrs[0], "amp/overflow": 1.0})
            self._taking = _Taking(step, values, [], True, None, t0, time.perf_counter(),
                                   explicit=explicit)
            return
        total, per_layer = layer_norms([n * unscale for n in host[k:]], layer_of,
                                       len(self.layers))
        values.update(zip(self._grad_names, [total, *per_layer]))
        values["lr"] = lrs[0]
        for i, lr in enumerate(lrs[1:], start=1):
            values[f"lr/group{i}"] = lr

        alerts = self.engine.observe("grads", step, values)
        nonfinite = not (math.isfinite(values["grad_norm/global"])
                         and math.isfinite(values.get("loss/train", 0.0)))
        # Skipping depends on the figures, not on the alert's episode: a second non-finite
        # step in a row is skipped too.
        skip = (nonfinite and self._skip_nonfinite) or any(
            "skip_step" in a.rule.actions for a in alerts)
        for a in alerts:
            if "clip" in a.rule.actions and not skip:
                limit = float(a.rule.params.get("max_norm", 1.0))
                if self.control.clip is None or self.control.clip > limit:
                    self.control.clip = limit
        g, clip = values["grad_norm/global"], self.control.clip
        applied = clip and not skip and math.isfinite(g)
        after = clip_(grads, g, clip) if applied else g
        if self.framework_clip and not skip and math.isfinite(after):
            after = after * min(1.0, self.framework_clip / (after + 1e-6))
        values["grad_norm/clipped"] = after
        if skip:
            # A parameter without a gradient is left alone by every torch optimizer, its
            # state included: the step changes nothing.
            for group in self.opt.param_groups:
                for p in group["params"]:
                    p.grad = None
            values["skipped"] = 1.0
        hist = self.spec.hist_every > 0 and not skip and (
            step % self.spec.hist_every == 0 or self.step == self._start_step)
        before = wprobe.snapshot(self.layers) if hist else None
        self._taking = _Taking(step, values, alerts, skip, before, t0, time.perf_counter(),
                               explicit=explicit)

    def post_step(self) -> None:
        """Optimizer post-hook: update ratios, and the LR factor off for the scheduler."""
        t = self._taking
        if t is None:
            return
        if t.before is not None:
            ratios = wprobe.update_ratios(self.layers, t.before).tolist()
            t.values.update({f"update_ratio/{n}": r for n, r in zip(self.layers.names, ratios)})
            t.before = []  # a histogram step: taken at its end
        self._sched_count = ctl.steps_taken(self.sched) if self.sched is not None else None
        self._lr_off()
        t.t_post = time.perf_counter()
        self._stepped = True

    def end_step(self, values: dict[str, float], names: list[str] | None = None,
                 parts: list[torch.Tensor] | None = None, *, data_s: float | None = None,
                 samples: int | None = None, extra_times: dict[str, float] | None = None
                 ) -> int:
        """Close the optimizer step just taken: its record (host `values`, plus device
        `parts` named `names`), timings, histograms. Returns the step number."""
        t_end = time.perf_counter()
        t = self._taking
        self._taking, self._stepped = None, False
        self._lr_on(only_if_scheduled=True)
        step = self.step + 1
        if t is None:  # a GradScaler found inf/NaN gradients and skipped the optimizer
            self.flush_deferred()  # steps are recorded in order
            values = {**values, "amp/overflow": 1.0}
            if self._repair_lr_after_overflow():
                values["lr"] = ctl.lrs(self.opt)[0]
            alerts: list = []
            if self._staged is not None:  # the runner's loss, never copied: copy it now
                names, parts = self._staged[0] + (names or []), self._staged[1] + (parts or [])
                self._staged = None
        else:
            values = {**t.values, **values}
            alerts = t.alerts
            values["time/probes"] = t.t_probe - t.t_pre
            values["time/optimizer"] = t.t_post - t.t_probe
        step_s = t_end - self._t_boundary
        if data_s is None:  # a loop of the user's: nbwatch does not see its data wait
            values["time/step"] = step_s
            if samples and step_s > 0:
                values["throughput/samples_per_s"] = samples / step_s
        else:
            values.update(timing_figures(step_s, data_s, None, samples))
        if extra_times:
            values.update(extra_times)
        self.step = step
        self.progress.step = step
        if parts:
            on_gpu = parts[0].device.type == "cuda" and t is not None
            if on_gpu and self.dist is None:
                self._deferred = _Deferred(step, list(names), list(parts), values, alerts)
            else:
                values.update(zip(names, _to_host(parts)))
                self._complete(step, values, alerts, t is None)
        else:
            self._complete(step, values, alerts, t is None)
        if t is not None and t.before is not None:
            self._histograms(step)
        if self.scaler is not None and isinstance(getattr(self.scaler, "_scale", None),
                                                  torch.Tensor):
            self._scale_ref = self.scaler._scale.clone()  # no sync: compared on overflow only
        if self.sched is not None:
            self._sched_at_end = ctl.steps_taken(self.sched)
        self._t_boundary = time.perf_counter()
        return step

    def _repair_lr_after_overflow(self) -> bool:
        """No optimizer step, so no post-hook took the LR factor off before the loop's
        `scheduler.step()`: a closed-form schedule then dropped it; put it back. Returns
        whether the LR now reads what the next step will use."""
        c = self.control
        if self.sched is None or c.lr_factor == 1.0 or c.lr_raw:
            return True
        n = ctl.steps_taken(self.sched)
        if n is None or n == self._sched_at_end:
            return True  # the scheduler did not step (the runner skips it on an overflow)
        if not ctl.chains(self.sched):
            ctl.scale_lrs(self.opt, c.lr_factor)
        return False

    def _complete(self, step: int, values: dict[str, float], alerts: list,
                  overflow: bool = False) -> None:
        """The step's figures are all on the host: derived figures, "step" rules, record."""
        tokens = values.get("tokens/real")
        if tokens is not None:
            padded = values.pop("_padded", None)
            if padded:
                values["data/padding_ratio"] = 1.0 - tokens / padded
            if values.get("time/step"):
                values["throughput/tokens_per_s"] = tokens / values["time/step"]
        loss = values.get("loss/train")
        if overflow and loss is not None and not math.isfinite(loss):
            alerts = alerts + self.engine.observe("grads", step, values)  # a real NaN
        elif overflow:
            values.pop("grad_norm/global", None)
        alerts = alerts + self.engine.observe("step", step, values)
        if self.dist is not None:
            self._rank_rows.append((step, {**rank_figures(values), "time/sync": self._sync_s}))
            self._sync_s = 0.0
            # run-level loss, tokens and throughput come from all ranks, at the next exchange
            stored = {k: v for k, v in values.items() if k not in _FROM_ALL_RANKS}
        else:
            stored = values
        self.store.put(Scalars(step, stored))
        if loss is not None and math.isfinite(loss):
            p = self.progress
            p.train_ema = SMOOTHING * p.train_ema + (1 - SMOOTHING) * loss
            p.train_ema_n += 1
        self._raise_alerts(alerts)
        every = self.spec.log_every
        if every and step % every == 0:
            self.log.info("step", extra={"step": step, "data": {
                k: values[k] for k in ("loss/train", "grad_norm/global", "lr", "time/step")
                if k in values}})

    def record_step(self, host: dict[str, float], names: list[str],
                    parts: list[torch.Tensor], *, lengths: torch.Tensor | None = None,
                    samples: int | None = None, val: Any = None,
                    reduction: str | None = None) -> int:
        """The end of an optimizer step in a loop nbwatch does not run (`Monitor.log`, the
        framework adapters): its record, its eval if `val`, a periodic checkpoint."""
        if lengths is not None:
            self.keep_seq_lens(lengths)
        self.save_reduction(reduction)
        step = self.end_step(host, names, parts, samples=samples)
        every = self.spec.checkpoint_every
        if val is not None:
            self.evaluate(val)
        elif every and step % every == 0:
            self.checkpoint("periodic")
        return step

    def boundary(self) -> bool:
        """Apply queued commands (pause blocks here); True once the run should stop."""
        self.apply_commands()
        return self.stopping

    def flush_deferred(self) -> None:
        """Copy and record a step whose device figures wait for the next gradient copy."""
        d, self._deferred = self._deferred, None
        if d is not None:
            d.values.update(zip(d.names, _to_host(d.parts)))
            self._complete(d.step, d.values, d.alerts)

    def save_reduction(self, reduction: str | None) -> None:
        if not self._reduction_saved and reduction:
            self.store.set_meta("loss_reduction", reduction)
            self._reduction_saved = True

    def keep_seq_lens(self, lengths: torch.Tensor) -> None:
        if self.spec.hist_every > 0:
            self._seq_lens.append(lengths)

    def _raise_alerts(self, alerts: list) -> None:
        """Record each alert, then carry out its actions (skip and clip are done already)."""
        for a in alerts:
            self._emit(a.event)
            if self.on_alert is not None:
                try:
                    self.on_alert(a.event)
                except Exception:  # a user's callback must not kill the run
                    self.log.exception("on_alert callback failed for %s", a.rule.name)
        for a in alerts:
            acts = a.rule.actions
            if self.dist is not None and a.rule.name not in SAME_ON_EVERY_RANK:
                # decided on rank 0 alone: applied by every rank at the next exchange
                for act in acts:
                    if act in ("pause", "checkpoint"):
                        self.commands.put(Command(act, None, f"alert:{a.rule.name}"))
                    elif act == "cut_lr":
                        f = float(a.rule.params.get("lr_factor", 0.5))
                        self.commands.put(Command("scale_lr", f, f"alert:{a.rule.name}"))
                continue
            if "cut_lr" in acts:
                f = float(a.rule.params.get("lr_factor", 0.5))
                self._apply(Command("scale_lr", f, f"alert:{a.rule.name}"))
            if "clip" in acts and self.control.clip is not None:
                self._emit(Event(self.step, "action", "info",
                                 f"gradient clipping at {self.control.clip:g} "
                                 f"(alert {a.rule.name})",
                                 {"command": "clip", "value": self.control.clip,
                                  "source": f"alert:{a.rule.name}"}))
            if "checkpoint" in acts:
                self._checkpoint(f"emergency ({a.rule.name})")
            if "pause" in acts:
                self._apply(Command("pause", None, f"alert:{a.rule.name}"))

    def _histograms(self, step: int) -> None:
        edges, counts = wprobe.layer_histograms(self.layers, self.spec.hist_bins)
        edges, counts = edges.cpu().double().numpy(), counts.cpu().numpy()
        for i, name in enumerate(self.layers.names):
            self.store.put(Histogram(step, f"weight/{name}", edges[i], counts[i]))
        stds = {n: weight_std(edges[i], counts[i]) for i, n in enumerate(self.layers.names)}
        self._raise_alerts(self.engine.observe("hist", step, weight_std=stds))
        if self._seq_lens:
            lens = torch.cat([t.float().cpu() for t in self._seq_lens])
            self._seq_lens.clear()
            hi = max(float(lens.max()), 1.0)
            e, c = wprobe.histogram(torch.cat([lens, lens.new_tensor([0.0, hi])]), 32)
            c[0] -= 1  # the two range anchors are not data: pin the range at [0, max]
            c[-1] -= 1
            self.store.put(Histogram(step, "data/seq_len", e.double().numpy(), c.numpy()))

    # -- eval ---------------------------------------------------------------------------
    def evaluate(self, val: Any = None) -> None:
        """The eval of this step: `val` as given (own loop) or `val_fn`, the attention
        probe, `sample_fn`; recorded, fed to the rules, checkpointed."""
        self.flush_deferred()  # loss/gap needs this step's train loss
        step = self.step
        result: EvalResult = evaluate(self.model, self.spec, step,
                                      self.progress.train_smooth(), val)
        if "loss/val" in result.values:
            v = result.values["loss/val"]
            self._last_val = v if math.isfinite(v) else None  # NaN is never "best"
        if result.probe_error is not None:
            self.probe_failed(result.probe_error)
        for a in result.attention:
            self.store.put(a)
        if result.sample is not None:
            self.store.put(Sample(step, result.sample))
        if result.values:
            self.store.put(Scalars(step, result.values))
            self._raise_alerts(self.engine.observe("eval", step, result.values))
        if result.attention:
            self._raise_alerts(self.engine.observe("attention", step,
                                                   attention=result.first_maps()))
        every = self.spec.checkpoint_every or self.spec.eval_every
        if not every or step % every == 0:
            self.checkpoint("periodic")
        self._t_boundary = time.perf_counter()

    def probe_failed(self, message: str) -> None:
        """The attention probe cannot work on this model: said once, then off."""
        self.spec.attention_samples = 0
        self._emit(Event(self.step, "probe", "warning", message))

    # -- checkpoints --------------------------------------------------------------------
    def note_checkpoint(self, reason: str, path: str | Path, seconds: float | None = None,
                        best: bool = False) -> None:
        """Record a checkpoint the framework wrote (a folder or a file)."""
        path = Path(path)
        size = _dir_bytes(path) if path.exists() else 0
        self._ckpt_step = self.step
        took = f" in {seconds:.2f} s" if seconds is not None else ""
        self._emit(Event(self.step, "checkpoint", "info",
                         f"{reason} checkpoint at step {self.step}: {path.name}, "
                         f"{size / 2**20:.1f} MiB{took}" + (" (best)" if best else ""),
                         {"path": str(path), "seconds": seconds, "bytes": size, "best": best,
                          "reason": reason}))

    def state_dict(self) -> dict[str, Any]:
        sched_state = getattr(self.sched, "state_dict", None)
        return {
            "model": plain(self.model).state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": sched_state() if callable(sched_state) else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": rng_state(),
            "controls": self.control.to_dict(),
        }

    def checkpoint(self, reason: str) -> None:
        self.flush_deferred()
        self._checkpoint(reason)
        self._t_boundary = time.perf_counter()

    def commit(self) -> None:
        """Put every record up to this step on disk. A checkpoint counts only after this:
        one newer than the store would leave a hole in a resumed run's history."""
        self.flush_deferred()
        self.store.flush(timeout=60)

    def _checkpoint(self, reason: str) -> None:
        if reason in ("final", "stop") and self._ckpt_step == self.step:
            return  # the periodic checkpoint of this very step is the final one
        self.commit()
        if self.save_fn is not None:  # the framework saves (on every rank, its own way)
            self.save_fn(reason)
            return
        if self.spec.trial or (self.dist is not None and self.dist.rank != 0):
            return
        self._ckpt_step = self.step
        saved = self.ckpt.save(self.state_dict(), self.step, self._last_val)
        self._last_val = None  # "best" compares checkpoints taken right after an eval
        msg = (f"{reason} checkpoint at step {self.step}: {saved.path.name}, "
               f"{saved.bytes / 2**20:.1f} MiB in {saved.seconds:.2f} s"
               + (" (best)" if saved.best else ""))
        self._emit(Event(self.step, "checkpoint", "info", msg, {
            "path": str(saved.path), "seconds": saved.seconds, "bytes": saved.bytes,
            "best": saved.best, "reason": reason}))


def plain(model: nn.Module) -> nn.Module:
    """The module a checkpoint holds: a torch.compile'd model's original module, so the
    keys carry no `_orig_mod.` and load into the uncompiled model as into the compiled."""
    return getattr(model, "_orig_mod", model)


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _to_host(parts: list[torch.Tensor], device: torch.device | None = None) -> list[float]:
    """One device→host copy of 0-dim tensors: one stack (dtypes promoted), one tolist."""
    if len(parts) == 1:
        return [parts[0].item()]
    try:
        return torch.stack(parts).tolist()
    except RuntimeError:  # on several devices (a model split across GPUs)
        dev = device or parts[-1].device
        return torch.stack([t.to(dev) for t in parts]).tolist()
