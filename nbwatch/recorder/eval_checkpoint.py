"""The eval of a step (`val_fn` or a logged `val`, the attention probe, `sample_fn`) and
checkpoints: nbwatch's own (rotation and "best" in `Checkpointer`) or a framework's."""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

from torch import nn

from ..checkpoint import rng_state
from ..evaluation import EvalResult, evaluate
from ..records import Event, Sample, Scalars


class EvalCheckpoint:
    """Part of `StepRecorder` (its state is set in `StepRecorder.__init__`)."""

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
        for missing, why in result.probe_notes.items():
            self.probe_note(missing, why)
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

    def step_done(self, eval_due: bool = False, val: Any = None) -> None:
        """The one policy after a step, in every loop: an eval when one is due (`eval_due`:
        start()'s eval_every; `val`: a loop's logged figures), which checkpoints as
        `evaluate` says; else the periodic checkpoint every `checkpoint_every` steps."""
        if eval_due or val is not None:
            self.evaluate(val)
        elif self.spec.checkpoint_every and self.step % self.spec.checkpoint_every == 0:
            self.checkpoint("periodic")

    def probe_failed(self, message: str) -> None:
        """The attention probe cannot work on this model: said once, then off."""
        self.spec.attention_samples = 0
        self._emit(Event(self.step, "probe", "warning", message))

    def probe_note(self, missing: str, message: str) -> None:
        """Figures the probe pass cannot take on this model (`missing`: "logits"), the probe
        staying on: said once a run, as a `probe` event the Health panel shows."""
        if missing not in self._probe_said:
            self._probe_said.add(missing)
            self._emit(Event(self.step, "probe", "info", message, {"missing": missing}))

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

    def _checkpoint(self, reason: str, announce: bool = True) -> Event | None:
        """Write a checkpoint; returns its event (recorded here unless `announce` is False:
        a command's outcome records it), or None where nbwatch wrote none itself."""
        if reason in ("final", "stop") and self._ckpt_step == self.step:
            return None  # the periodic checkpoint of this very step is the final one
        self.commit()
        if self.save_fn is not None:  # the framework saves (on every rank, its own way)
            self.save_fn(reason)
            return None
        if self.spec.trial or (self.dist is not None and self.dist.rank != 0
                               and not self.ckpt.every_rank):  # FSDP2: every rank saves
            return None
        try:
            saved = self.ckpt.save(self.state_dict(), self.step, self._last_val)
        except Exception as e:  # recorded here; the run then fails with it (a full disk)
            first = (str(e).strip().splitlines() or [""])[0]
            with contextlib.suppress(Exception):  # a dead store: the error matters more
                self._emit(Event(self.step, "checkpoint", "critical",
                                 f"{reason} checkpoint at step {self.step} failed: {first}",
                                 {"reason": reason, "failed": True,
                                  "error": f"{type(e).__name__}: {first}"}))
            raise
        self._ckpt_step = self.step
        self._last_val = None  # "best" compares checkpoints taken right after an eval
        msg = (f"{reason} checkpoint at step {self.step}: {saved.path.name}, "
               f"{saved.bytes / 2**20:.1f} MiB in {saved.seconds:.2f} s"
               + (" (best)" if saved.best else ""))
        ev = Event(self.step, "checkpoint", "info", msg, {
            "path": str(saved.path), "seconds": saved.seconds, "bytes": saved.bytes,
            "best": saved.best, "reason": reason})
        if announce:
            self._emit(ev)
        return ev


def plain(model: nn.Module) -> nn.Module:
    """The module a checkpoint holds: a torch.compile'd model's original module, so the
    keys carry no `_orig_mod.` and load into the uncompiled model as into the compiled."""
    return getattr(model, "_orig_mod", model)


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

