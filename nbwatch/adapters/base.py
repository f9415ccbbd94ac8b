"""What the framework adapters share: `Adapter` (one run of a fit nbwatch does not drive:
which thread owns it, its folder, its Monitor opened at the framework's first step, the
step's figures recorded from the framework's moment), and the framework's own objects
behind their wrappers. The handle `start()` returns is fit_run.py's `FitRun`.
"""

from __future__ import annotations

import difflib
import inspect
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import controls as ctl
from ..distributed import rank0_run_dir
from ..probes.combined import Split, Tally
from ..probes.data import LengthCounts, decoder_mask, is_encoder_decoder, packed_positions
from ..run import started_run
from .fit_run import FitRun

if TYPE_CHECKING:
    import torch

    from ..monitor import Monitor
    from ..monitor.port import ExternalLoop

class Adapter:
    """What a framework's callback keeps: where the run goes, the Monitor it opens when
    the fit begins, the handle of `start()`, and the step's micro-batch losses and masks.

    One fit at a time: a callback records the fit of the thread that began it, refuses a
    second one while that fit runs (another Trainer given the same callback, a second
    `start()`), and forgets all of a fit that ended before it records the next one."""

    # the run's options its framework gives it (name → where a user sets them)
    TAKEN: Mapping[str, str] = {}

    def __init__(self, run_dir: str | os.PathLike | None = None,
                 config: dict[str, Any] | None = None, **monitor_kwargs: Any):
        from ..monitor.inputs import as_config, default_run_dir

        self.run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
        self._named_here = run_dir is None  # by this rank's clock: rank 0's at the fit
        self.config = as_config(config)
        check_run_options(type(self).__module__.replace("nbwatch.adapters.", "nbwatch.")
                          + ".NbwatchCallback", monitor_kwargs, self.TAKEN)
        self.monitor_kwargs = monitor_kwargs
        self.name = monitor_kwargs.get("name") or self.run_dir.name
        self.monitor: Monitor | None = None
        self.loop: ExternalLoop | None = None  # the fit's run, once its first step opened it
        self.handle: FitRun | None = None
        self._commands = ctl.CommandQueue()  # shared with the handle, then the Monitor
        self._clear_step()
        self._enc_dec: tuple[Any, bool] | None = None  # (model, whether it is one)
        self._fitting = False  # a fit is taken: from start()'s launch, or the fit's begin
        self._owner: threading.Thread | None = None  # … in this thread (None: not begun)
        self._fit_trainer: Any = None  # … of this Trainer
        self._taking = threading.Lock()

    def _rec(self) -> ExternalLoop | None:
        """The run of the fit this callback records, in that fit's thread only: a Trainer
        that shares the callback must not write into another fit's run."""
        if self.loop is None or threading.current_thread() is not self._owner:
            return None
        return self.loop

    # -- one fit at a time --------------------------------------------------------------
    def _fit_running(self) -> bool:
        """A fit this callback records is under way, in a thread other than the caller's
        (a fit taken in the caller's thread that is still marked taken ended unseen)."""
        if not self._fitting:
            return False
        owner = self._owner
        if owner is None:
            return True  # start() launched it; its thread has not begun the fit yet
        return owner is not threading.current_thread() and owner.is_alive()

    def _busy(self, api: str, trainer: Any) -> str:
        """The one-line refusal of a second fit while this callback's fit runs."""
        mon = self.monitor
        where = (f"recorded into {self.run_dir} (step {mon.step if mon is not None else 0})")
        if trainer is not None and trainer is self._fit_trainer:
            return (f"{api}: this Trainer's fit is already running, {where}: wait() for it "
                    "or stop() it first (through the handle start() returned)")
        return (f"{api}: this NbwatchCallback already records a fit running in another "
                f"Trainer, {where}: give each Trainer its own NbwatchCallback(run_dir=...), "
                "or wait for that fit to end first")

    def _settle(self, api: str, trainer: Any) -> None:
        """Refuse a new fit while this callback's runs; else close what a fit that ended
        unseen left open (under `_taking`: a fit is taken only under it, so what is closed
        here is never a live fit's)."""
        if self._fit_running():
            raise RuntimeError(self._busy(api, trainer))
        self._close_unseen()

    def _take(self, api: str, thread: threading.Thread | None, trainer: Any) -> None:
        """Take the fit beginning now: refuse it while another runs; close what a fit that
        ended unseen left open; forget everything of the last fit."""
        with self._taking:
            self._settle(api, trainer)
            self._forget()
            self._fitting, self._owner, self._fit_trainer = True, thread, trainer

    def _forget(self) -> None:
        """What one fit kept, gone before the next: its Monitor, handle, commands (a stop
        sent as it ended must not stop the next), micro-batches. Subclasses add theirs."""
        self.monitor = self.handle = self.loop = None
        self._commands = ctl.CommandQueue()
        self._clear_step()

    def _clear_step(self) -> None:
        """The step's micro-batches noted so far, none."""
        self._losses: list[Any] = []
        self._masks: list[Any] = []
        self._positions: list[Any] = []  # a packed batch's position_ids, per micro-batch
        self._unmasked: list[Any] = []  # … of those that came without a mask (all real)
        self._rows: list[Any] = []  # the masks of the micro-batches not packed
        self._tally = Tally()  # their samples
        self._logit_mask: Any = None  # an encoder-decoder's first micro-batch's target mask

    def _note_batch(self, batch: Any, split: Split, tokens: list) -> None:
        """A micro-batch, in its parts (`loader_batches`), and each part's tokens (None:
        none), kept for the step's figures: a packed part's position_ids for its documents'
        (without a mask its tokens are all real, counted from its shape); the mask of one
        not packed gives its rows, each a sample beside the packed ones' documents; one of
        no tokens (pixels, an `(x, y)` beside a batch of text) its samples (`Tally`)."""
        bare = []
        for part, mask in zip(split.parts, tokens):
            if mask is not None:
                self._masks.append(mask)
            pos = packed_positions(part)
            if pos is None:
                if mask is not None:
                    self._rows.append(mask)
                else:
                    bare.append(part)
                continue
            self._positions.append(pos)
            if mask is None:
                self._unmasked.append(pos)
        self._tally.add(batch, split, bare)

    def _close_unseen(self) -> None:
        """The last fit ended without telling us (an exception the framework passes to no
        callback, past the adapter's guards): close its run as failed, which gives back
        its store, its sampler and the folder's writer lock. No emergency checkpoint: the
        model and optimizer may be the next fit's by now."""
        mon, loop = self.monitor, self.loop
        if mon is None or mon.closed or loop is None:
            return
        loop.abandon("the fit ended without telling nbwatch (an exception its framework "
                     "passes to no callback); its run was closed when the callback began "
                     "its next fit")

    def _begin(self, api: str, trainer: Any, resuming: bool, how: str) -> None:
        """The framework's fit begins in this thread (its train-begin event): take it,
        unless start() took it at its launch; refuse a new run over a recorded one."""
        me = threading.current_thread()
        if self.handle is not None and self._fitting and self._owner is me:
            self._close_unseen()  # the framework began again inside start()'s fit
            self._clear_step()
            self._check_fresh(resuming, how)
            return
        with self._taking:  # refused before anything is taken; the last fit closed
            self._settle(api, trainer)
        self._rank0_dir()
        self._check_fresh(resuming, how)
        self._take(api, me, trainer)

    def _rank0_dir(self) -> None:
        """Under torchrun, a default run folder is rank 0's on every rank (a collective)."""
        if self._named_here:
            own = self.run_dir
            self.run_dir, self._named_here = rank0_run_dir(own), False
            if self.name == own.name:
                self.name = self.run_dir.name

    def _check_fresh(self, resuming: bool, how: str) -> None:
        """A fit from step 0 must not write over the run a folder holds (the Monitor would
        refuse it too, naming its own way to resume, not the framework's)."""
        from ..monitor.inputs import rank

        if resuming or rank() != 0:
            return
        try:
            run = started_run(self.run_dir.absolute())
            held = run.step if run is not None else 0
        except Exception:  # noqa: BLE001 - a damaged folder: the Monitor's open says so
            return
        if held:
            raise FileExistsError(
                f"run_dir {self.run_dir} already holds a run at step {held}: record this fit "
                f"into a new run_dir, or continue that run from a checkpoint of the "
                f"framework ({how})")

    def _open(self, mon: Monitor, framework: str, start_step: int | None, *,
              save: Callable[[str], None], clip: float | None = None,
              measure_in_hook: bool = True) -> ExternalLoop:
        """Open the run of the fit now begun; its Monitor takes the commands queued so
        far (the handle's queue), then the handle reads it."""
        self.monitor = mon
        loop = self.loop = mon.open_external(framework, start_step, save=save, clip=clip,
                                             measure_in_hook=measure_in_hook,
                                             commands=self._commands)
        if self.handle is not None:
            self.handle.monitor = mon
        return loop

    def _note_logit_mask(self, model: Any, batch: Any) -> None:
        """An encoder-decoder model's logits are the target's: the first micro-batch's
        target mask weights them (its `attention_mask` is the source's)."""
        if self._enc_dec is None or self._enc_dec[0] is not model:  # looked up once a fit
            self._enc_dec = (model, is_encoder_decoder(model))
        if self._logit_mask is None and self._enc_dec[1]:
            self._logit_mask = decoder_mask(batch)

    def _record_step(self, host: dict[str, float], reduction: str) -> bool:
        """Record the optimizer step just taken from its micro-batches' losses (each
        already divided by the accumulation count, so summed), masks and samples (`Tally`);
        apply the commands (pause blocks here). True once the fit should stop."""
        import torch

        from ..probes.data import BESIDE, all_real, batch_figures, documents
        from ..probes.late import keep_masks

        rec = self._rec()
        assert rec is not None  # the adapters call it in the fit's thread, once it opened
        losses, masks, positions = self._losses, self._masks, self._positions
        unmasked, rows, tally, logit_mask = (self._unmasked, self._rows, self._tally,
                                             self._logit_mask)
        self._clear_step()
        names: list[str] = []
        parts: list[Any] = []
        lengths: torch.Tensor | LengthCounts | None = None
        with rec.own:
            if losses:
                names.append("loss/train")
                parts.append(torch.stack([x.float().reshape(()) for x in losses]).sum())
            if masks:
                if unmasked:  # packed micro-batches beside masked ones: every token theirs
                    masks = masks + [torch.ones_like(p, dtype=torch.bool) for p in unmasked]
                # the run's first masks are read now (a bad one is refused at once); later
                # ones are copied and read with the record, a batch of steps at a time
                if rec.first_step or positions or not keep_masks(host, masks):
                    lengths = batch_figures(masks).into(names, parts, host)
            if positions:  # packed: its documents' count, longest and lengths
                if not masks and unmasked:  # every token real: known from the shapes
                    all_real(unmasked).into(names, parts, host)
                lengths = documents(positions, names, parts, rows)
                host[BESIDE] = float(tally.beside)  # micro-batches of no tokens
            # the first micro-batch's forward: its mask leaves its padding out (an
            # encoder-decoder's: its target's alone, never its source's)
            if logit_mask is None and masks and not (self._enc_dec and self._enc_dec[1]):
                logit_mask = masks[0]
            lnames, lparts = rec.logit_figures(logit_mask, host)
            names += lnames
            parts += lparts
        return rec.record_step(host, names, parts, lengths=lengths, samples=tally.samples,
                               reduction=reduction)

    def _ends_here(self) -> bool:
        """The framework's end event ends the run here: a fit of the callback alone (no
        start() handle), in its own thread (not another Trainer's sharing the callback)."""
        return (self.handle is None and self._fitting
                and self._owner is threading.current_thread())

    def _end(self, error: BaseException | None) -> None:
        """The fit returned (or raised): end the run as finished, stopped or failed, and
        give back all it took."""
        try:
            if self.loop is not None:
                self.loop.end(error)  # the output layer's hook goes with the run
        finally:
            self._fitting, self._owner = False, None

    def _prepare(self, api: str, trainer: Any, resuming: bool, how: str) -> None:
        """start()'s checks, all before anything is taken: no fit of this callback running,
        a folder it may write, no run there it would write over, no other writer."""
        from ..monitor.inputs import check_run_dir
        from ..store import check_no_writer

        with self._taking:
            self._settle(api, trainer)  # its own stale writer lock must not refuse it
        self._rank0_dir()
        check_run_dir(self.run_dir)
        self._check_fresh(resuming, how)
        check_no_writer(self.run_dir)

    def _launch(self, api: str, trainer: Any, fit: Callable[[], Any],
                display: bool | None) -> FitRun:
        """Run `fit` in a background thread; return its handle (and show the dashboard)."""
        from ..notebook import in_notebook as _in_notebook

        self._take(api, None, trainer)

        def owned() -> Any:
            self._owner = threading.current_thread()  # before the fit's begin event
            return fit()

        handle = self.handle = FitRun(self.run_dir, self.name, self._commands)
        try:
            handle._start(owned, self._end)
        except BaseException:
            self._fitting, self.handle = False, None
            raise
        if display is None:
            display = _in_notebook()
        if display:
            handle.show()
        return handle


def run_options(taken: Mapping[str, str]) -> list[str]:
    """The keywords of the run a callback records: the Monitor's, less what the callback
    and its framework give it (`taken`: name → where the framework sets it)."""
    from ..monitor import Monitor

    return [n for n in inspect.signature(Monitor.__init__).parameters
            if n not in ("self", "model", "optimizer", "scheduler", "run_dir", "config")
            and n not in taken]


def check_run_options(api: str, options: Mapping[str, Any], taken: Mapping[str, str]) -> None:
    """Refuse, where they are given, keywords that are no option of the run (rather than
    in the fit's first step)."""
    known = run_options(taken)
    for k in options:
        if k in taken:
            raise TypeError(f"{api}: {k!r} is the framework's to give the run: {taken[k]}")
        if k not in known:
            near = difflib.get_close_matches(k, known, n=1)
            raise TypeError(f"{api}: {k!r} is no option of the run"
                            + (f"; did you mean {near[0]!r}?" if near else "")
                            + f" Its options: {', '.join(known)}")


def check_fit_arguments(api: str, fit: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                        taken: Mapping[str, str]) -> None:
    """Refuse, at the call, arguments the framework's fit would refuse in its thread once
    the run had begun; one of the run's own options is named as `monitor={...}` (a fit
    that takes any keyword, as transformers 4's `train(**kwargs)`, is left to refuse the
    others itself)."""
    name = getattr(fit, "__qualname__", "fit")
    known = run_options(taken)
    ours = [k for k in kwargs if k in known]
    if ours:
        raise TypeError(f"{api}: {ours[0]}= is an option of the run, not of {name}(): "
                        f"pass monitor={{{ours[0]!r}: ...}}")
    try:
        inspect.signature(fit).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{api}: {name}() would refuse these arguments: {e}") from None


def callback_of(found: list[Any], make: Callable[[], Any], *, api: str, detach: str,
                run_dir: str | os.PathLike | None, config: dict[str, Any] | None,
                monitor: dict[str, Any] | None) -> tuple[Any, bool]:
    """The callback start() records the fit with: the Trainer's own (refused where it
    would ignore this call's run_dir, config or monitor), else a new one (True: to add,
    for this fit only)."""
    if len(found) > 1:
        raise ValueError(f"{api}: this Trainer has {len(found)} NbwatchCallbacks, which "
                         f"would record one fit {len(found)} times; keep one ({detach})")
    if not found:
        return make(), True
    cb = found[0]
    ignored = [name for name, v in (("config", config), ("monitor", monitor)) if v]
    if run_dir is not None and Path(run_dir).absolute() != cb.run_dir.absolute():
        ignored.insert(0, f"run_dir={str(run_dir)!r}")
    if ignored and not cb._fit_running():  # a running fit: its own refusal says more
        raise ValueError(
            f"{api}: this Trainer already has an NbwatchCallback recording into "
            f"{cb.run_dir}, which would ignore the {' and '.join(ignored)} given here: "
            f"give them to that callback, or remove it first ({detach})")
    return cb, False


def unwrap(obj: Any, attr: str) -> Any:
    """The object behind a framework's wrapper (`AcceleratedOptimizer.optimizer`, …)."""
    seen = 0
    while hasattr(obj, attr) and seen < 4 and getattr(obj, attr) is not obj:
        inner = getattr(obj, attr)
        if inner is None:
            break
        obj, seen = inner, seen + 1
    return obj


def found_inf(scaler: Any, optimizer: Any) -> torch.Tensor | None:
    """A GradScaler's verdict on `optimizer`'s gradients since it unscaled them: > 0 where
    one was not finite (it then skips the step); on the device, no sync. `GradScaler`'s
    `_per_optimizer_states`."""
    states = getattr(scaler, "_per_optimizer_states", None)
    state = states.get(id(unwrap(optimizer, "optimizer"))) if isinstance(states, dict) else None
    found = list((state or {}).get("found_inf_per_device", {}).values())
    if not found:
        return None
    import torch

    return found[0] if len(found) == 1 else torch.stack(
        [f.to(found[0].device) for f in found]).sum()


def drop_repeats(callbacks: Any, cb: Any, framework: str, remove: str) -> None:
    """Keep one registration of `cb` in a framework's list of callbacks (`callbacks=[cb,
    cb]`, or a cell run twice that adds it again: each event would reach it twice, each
    step recorded twice), and say so. Called from an event of the first one, it deletes
    later ones only, which the framework's loop over its callbacks then skips."""
    if not isinstance(callbacks, list):
        return
    at = [i for i, c in enumerate(callbacks) if c is cb]
    for i in reversed(at[1:]):
        del callbacks[i]
    if len(at) > 1:
        warnings.warn(
            f"this NbwatchCallback was given to this {framework} {len(at)} times; it records "
            f"each step once (the repeats were removed from the {framework}'s callbacks): "
            f"add it once, e.g. guard a cell run twice with {remove}", stacklevel=3)
