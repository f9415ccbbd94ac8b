"""The eval of a step (`val_fn` or a logged `val`, the attention probe, `sample_fn`) and
checkpoints: nbwatch's own (rotation and "best" in `Checkpointer`) or a framework's."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from torch import nn

from ..checkpoint import bare_module, model_state, rng_state
from ..evaluation import EvalResult, evaluate
from ..records import Event, Sample, Scalars
from ..samples import sample_content
from .spec import Progress, RunSpec
from .state import InFlight

if TYPE_CHECKING:
    from ..alerts.engine import AlertEngine
    from ..checkpoint import Checkpointer
    from ..controls import ControlState
    from ..distributed import Dist, NullStore
    from ..store import RunStore
    from .lr_factor import LrFactor
    from .state import RewindState


@dataclass
class EvalState:
    """What the evals and checkpoints of a run remember between steps."""

    last_val: float | None = None  # the newest finite val loss, until a checkpoint takes it
    last_val_step: int | None = None  # its step: only a checkpoint of that step is "best"
    ckpt_step: int | None = None  # the step of the newest checkpoint
    ckpt_path: str = ""  # its file or folder
    probe_said: set[str] = field(default_factory=set)  # figures the probe cannot take, said


class Evaluating(Protocol):
    """What an eval and a checkpoint read and write of their run (a `StepRecorder`)."""

    step: int
    spec: RunSpec
    model: nn.Module
    opt: Any
    sched: Any
    scaler: Any
    control: ControlState
    store: RunStore | NullStore  # NullStore on ranks > 0
    ckpt: Checkpointer
    dist: Dist | None
    engine: AlertEngine
    progress: Progress
    evals: EvalState
    save_fn: Callable[[str], None] | None
    flight: InFlight
    rewind_state: RewindState
    lr: LrFactor

    def flush_deferred(self) -> None: ...
    def _emit(self, ev: Event, level: int | None = None) -> None: ...
    def _raise_alerts(self, alerts: list) -> None: ...


def run_eval(rec: Evaluating, val: Any = None, probe_only: bool = False) -> None:
    """The eval of this step: `val` as given (own loop) or `val_fn`, the attention
    probe, `sample_fn`; recorded, fed to the rules, checkpointed (`probe_only`: the probe
    between evals, checkpointed only on a `checkpoint_every` step)."""
    rec.flush_deferred()  # loss/gap needs this step's train loss
    step = rec.step
    result: EvalResult = evaluate(rec.model, rec.spec, step,
                                  rec.progress.train_smooth(), val)
    if "loss/val" in result.values:
        v = result.values["loss/val"]
        rec.evals.last_val = v if math.isfinite(v) else None  # NaN is never "best"
        rec.evals.last_val_step = step
    if result.probe_error is not None:
        probe_failed(rec, result.probe_error, result.probe_severity)
    for missing, why in result.probe_notes.items():
        probe_note(rec, missing, why, result.probe_note_severity.get(missing, "info"))
    for a in result.attention:
        rec.store.put(a)
    if result.sample is not None:
        try:
            text, content = sample_content(result.sample)
        except ValueError as e:  # said, and the run goes on: a sample is no training figure
            rec._emit(Event(step, "probe", "warning", f"{e}; recorded as its text instead"))
            text, content = str(result.sample)[:2000], None
        rec.store.put(Sample(step, text, content=content))
    if result.values:
        rec.store.put(Scalars(step, result.values))
        rec._raise_alerts(rec.engine.observe("eval", step, result.values))
    if result.attention:
        rec._raise_alerts(rec.engine.observe("attention", step,
                                               attention=result.first_maps()))
    every = rec.spec.checkpoint_every or (None if probe_only else rec.spec.eval_every)
    if (not every and not probe_only) or (every and step % every == 0):
        checkpoint(rec, "periodic")
    rec.flight.t_boundary = time.perf_counter()

def step_done(rec: Evaluating, eval_due: bool = False, val: Any = None,
              probe: bool = False) -> None:
    """The one policy after a step, in every loop: an eval when one is due (`eval_due`:
    start()'s eval_every; `val`: a loop's logged figures), which checkpoints as
    `evaluate` says; the probe alone (`probe`: a loop's `probe_every`), which does not;
    else the periodic checkpoint every `checkpoint_every` steps."""
    if eval_due or val is not None:
        run_eval(rec, val)
    elif probe:
        run_eval(rec, None, probe_only=True)
    elif rec.spec.checkpoint_every and rec.step % rec.spec.checkpoint_every == 0:
        checkpoint(rec, "periodic")

def probe_failed(rec: Evaluating, message: str, severity: str = "warning") -> None:
    """The attention probe cannot work on this model: said once, then off ("info": a
    model without attention layers)."""
    rec.spec.attention_samples = 0
    rec._emit(Event(rec.step, "probe", severity, message))

def probe_note(rec: Evaluating, missing: str, message: str, severity: str = "info") -> None:
    """Figures the probe pass cannot take on this model (`missing`: "logits"), the probe
    staying on: said once a run, as a `probe` event the Health panel shows."""
    if missing not in rec.evals.probe_said:
        rec.evals.probe_said.add(missing)
        rec._emit(Event(rec.step, "probe", severity, message, {"missing": missing}))

def note_checkpoint(rec: Evaluating, reason: str, path: str | Path, seconds: float | None = None,
                    best: bool = False, kept: bool = True) -> None:
    """Record a checkpoint the framework wrote (a folder or a file); `kept`: one a stop or
    a command may name as these weights' (not one a top-k policy may delete later)."""
    path = Path(path)
    size = _dir_bytes(path) if path.exists() else 0
    if kept:
        rec.evals.ckpt_step, rec.evals.ckpt_path = rec.step, str(path)
    took = f" in {seconds:.2f} s" if seconds is not None else ""
    rec._emit(Event(rec.step, "checkpoint", "info",
                     f"{reason} checkpoint at step {rec.step}: {path.name}, "
                     f"{size / 2**20:.1f} MiB{took}" + (" (best)" if best else ""),
                     {"path": str(path), "seconds": seconds, "bytes": size, "best": best,
                      "reason": reason}))

def state_dict(rec: Evaluating) -> dict[str, Any]:
    sched_state = getattr(rec.sched, "state_dict", None)
    return {
        "model": model_state(plain(rec.model)),  # (a PEFT model's: not its frozen base)
        "optimizer": rec.opt.state_dict(),
        "scheduler": sched_state() if callable(sched_state) else None,
        # taken between the optimizer's step and the scheduler's (a stop or an error there;
        # log() before scheduler.step()): the step's number, the scheduler one step behind
        "scheduler_behind": int(rec.lr.behind()),
        "scaler": rec.scaler.state_dict() if rec.scaler is not None else None,
        "rng": rng_state(),
        "controls": rec.control.to_dict(),
        "data": data_at(rec.rewind_state),
        "data_order": rec.rewind_state.data_order,
        "alert_start": dict(rec.engine.start),  # the alert floors' reference, resumed
    }

def data_at(st: Any) -> list[int] | None:
    """Where a resume of start()'s loop goes on in the data (`RewindState.data_at`), past
    the batches a skip has yet to throw away (a stop pressed with a rewind and its skip)."""
    if st.data_at is None:
        return None
    epoch, index = st.data_at
    return [epoch, index + st.skip_batches]

def checkpoint(rec: Evaluating, reason: str) -> None:
    rec.flush_deferred()
    write_checkpoint(rec, reason)
    rec.flight.t_boundary = time.perf_counter()

def commit(rec: Evaluating) -> None:
    """Put every record up to this step on disk. A checkpoint counts only after this:
    one newer than the store would leave a hole in a resumed run's history."""
    rec.flush_deferred()
    rec.store.flush(timeout=60)

def write_checkpoint(rec: Evaluating, reason: str, announce: bool = True) -> Event | None:
    """Write a checkpoint; returns its event (recorded here unless `announce` is False:
    a command's outcome records it), or None where nbwatch wrote none itself."""
    st = rec.evals
    if st.ckpt_step == rec.step:  # these weights are on disk already (the periodic's)
        if reason in ("final", "stop", "periodic"):  # nothing asked for: nothing to say
            return None
        done = Event(rec.step, "action", "info",
                     f"{reason} checkpoint at step {rec.step}: written already, "
                     f"{Path(st.ckpt_path).name}", {"path": st.ckpt_path, "already": True})
        if announce:
            rec._emit(done)
        return done
    commit(rec)
    if rec.save_fn is not None:  # the framework saves (on every rank, its own way)
        rec.save_fn(reason)
        return None
    if rec.spec.trial or (rec.dist is not None and rec.dist.rank != 0
                           and not rec.ckpt.every_rank):  # FSDP2: every rank saves
        return None
    try:
        # the val loss of these weights only (an eval off the checkpoint steps: no "best")
        saved = rec.ckpt.save(state_dict(rec), rec.step,
                              st.last_val if st.last_val_step == rec.step else None)
    except Exception as e:  # recorded here; the run then fails with it (a full disk)
        first = (str(e).strip().splitlines() or [""])[0]
        with contextlib.suppress(Exception):  # a dead store: the error matters more
            rec._emit(Event(rec.step, "checkpoint", "critical",
                             f"{reason} checkpoint at step {rec.step} failed: {first}",
                             {"reason": reason, "failed": True,
                              "error": f"{type(e).__name__}: {first}"}))
        raise
    st.ckpt_step, st.ckpt_path = rec.step, str(saved.path)
    st.last_val = None  # "best" compares checkpoints taken right after an eval
    msg = (f"{reason} checkpoint at step {rec.step}: {saved.path.name}, "
           f"{saved.bytes / 2**20:.1f} MiB in {saved.seconds:.2f} s"
           + (" (best)" if saved.best else ""))
    ev = Event(rec.step, "checkpoint", "info", msg, {
        "path": str(saved.path), "seconds": saved.seconds, "bytes": saved.bytes,
        "best": saved.best, "reason": reason})
    if announce:
        rec._emit(ev)
    return ev


def plain(model: nn.Module) -> nn.Module:
    """The module a checkpoint holds (`checkpoint.bare_module`)."""
    return cast(nn.Module, bare_module(model))


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

