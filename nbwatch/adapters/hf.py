"""Hugging Face `Trainer`: watch and steer `trainer.train()` with one line.

    mon = nbwatch.hf.start(trainer, run_dir="runs/hf")      # in a notebook: returns at once
    Trainer(..., callbacks=[nbwatch.hf.NbwatchCallback(run_dir="runs/hf")])   # in a script

Built on the step recorder of `Monitor.log()`: the gradient figures are taken at the
Trainer's own step (before its clipping), and the controls act through the Trainer's own
mechanisms: stop sets `control.should_training_stop`, checkpoint runs the Trainer's own
save of a `checkpoint-N` folder at the step it is taken, paused or not (written while the
pause holds; `train(resume_from_checkpoint=...)` takes it), pause blocks between
optimizer steps, clip and cut LR act from the next step (and the Trainer's own logged
`learning_rate` reads the LR the optimizer uses, cut included).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

try:
    from transformers import Trainer, TrainerCallback
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError(
        "nbwatch.hf needs the transformers package: pip install 'nbwatch[hf]'") from None

import torch

from ..distributed import lost_peer
from ..interrupts import Terminated
from ..monitor import Monitor
from ..probes.attention import take_samples
from ..probes.combined import loader_batches
from ..probes.data import input_tokens, packed_positions
from .base import Adapter, callback_of, check_fit_arguments, drop_repeats, unwrap
from .fit_run import FitRun
from .hf_internals import (  # noqa: F401 - wrap_clip_grad_norm: part of nbwatch.hf
    PRIVATE_STEPS,
    attention_implementation,
    calling_trainer,
    retries_at_smaller_batch,
    save_checkpoint_now,
    set_last_lr,
    train_batch_size,
    wrap_clip_grad_norm,
)

__all__ = ["NbwatchCallback", "start"]
SUPPORTED = "transformers 4.46 – 5.x (tested with 5.24)"
_NOT_METRICS = ("runtime", "samples_per_second", "steps_per_second", "epoch")
_RESUME = "trainer.train(resume_from_checkpoint=...)"
_GUARDED = ("get_batch_samples", "evaluate")  # public: where a fit's data and eval fail


class _Retry(NamedTuple):
    """A try of the fit that ran out of memory under `auto_find_batch_size`: the Trainer
    begins the fit again, from its first step, at a smaller batch."""

    trainer: Trainer
    batch_size: int | None
    step: int
    error: str


class NbwatchCallback(Adapter, TrainerCallback):
    """Records every optimizer step of a `Trainer` into `run_dir`, and takes the controls.

    Keyword arguments are the Monitor's: `config` (stored beside the TrainingArguments),
    `name`, `alerts`, `on_alert`, `probe_batch` (default: the first samples of the first
    eval batch), `attention_samples`, `hist_every`, `rank_every`, `dist_timeout`.

    One fit at a time: while its fit runs, another Trainer given the same callback is
    refused at its `train()`; once that fit ended, the callback may record the next one
    (into the same run_dir: a continuation, `train(resume_from_checkpoint=...)`).
    """

    TAKEN = {"max_steps": "TrainingArguments(max_steps=...)",
             "scaler": "the Trainer's own GradScaler, found by nbwatch",
             "resume": "trainer.train(resume_from_checkpoint=...) resumes the run too"}

    def __init__(self, run_dir: str | os.PathLike | None = None,
                 config: dict[str, Any] | None = None, **monitor_kwargs: Any):
        super().__init__(run_dir, config, **monitor_kwargs)
        self.trainer: Trainer | None = None
        self._save_reason: str | None = None
        self._wrapped: tuple[Trainer, list[str]] | None = None
        self._at_boundary = False  # in on_step_end, where the commands are applied
        self._saved_step: int | None = None  # the step nbwatch last saved the Trainer's way
        self._save_t0: float | None = None  # when that save began (its time, in on_save)
        self._retry: _Retry | None = None  # the last try ran out of memory (not _forget's)
        self._interrupted = False  # the fit ends by a Ctrl-C in its own (foreground) thread
        self._raised_by: BaseException | None = None  # what ended the fit, if it raised

    # -- the Trainer's events -----------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kw: Any) -> None:
        trainer = calling_trainer() or (self._fit_trainer if self.handle is not None else None)
        _drop_repeats(trainer, self)
        retry, self._retry = self._retry, None
        if retry is not None and (trainer is not retry.trainer or not (
                (train_batch_size(trainer) or 0) < (retry.batch_size or 0))):
            retry = None  # not the Trainer's retry: a new fit, checked as one
        self._begin("nbwatch.hf", trainer, bool(state.global_step) or retry is not None,
                    _RESUME)
        self.trainer = trainer
        opt = unwrap(optimizer, "optimizer")
        sched = unwrap(lr_scheduler, "scheduler")
        if not callable(getattr(sched, "step", None)):
            sched = None  # (ReduceLROnPlateau, stepped at the Trainer's evals, is kept)
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        kwargs = {"display": False, "probe_fn": probe_forward, **self.monitor_kwargs}
        config = {"trainer": args.to_sanitized_dict(), **self.config}
        mon = Monitor(model, opt, sched, self.run_dir, config, scaler=scaler,
                      max_steps=state.max_steps or None, **kwargs)
        # a retry is opened at its step (0), over the last try's steps
        loop = self._open(mon, "hf", state.global_step if retry else (state.global_step or None),
                          save=self._save, clip=args.max_grad_norm or None)
        wrapped = getattr(trainer, "model_wrapped", None)  # under torchrun, the straggler's
        if isinstance(wrapped, torch.nn.Module) and wrapped is not model:  # clock on DDP's
            loop.clock_forwards(wrapped)  # forward: its buffers' broadcast left out of busy
        if retry is not None:
            dropped = retry.step - state.global_step
            loop.note(f"the try at batch size {retry.batch_size} ran out of memory at step "
                      f"{retry.step} ({retry.error}); the Trainer's auto_find_batch_size "
                      f"began the fit again at batch size {train_batch_size(trainer)}"
                      + (f", and the {dropped} steps of that try were dropped"
                         if dropped > 0 else ""))
        if trainer is not None:
            self._wrap(trainer)
        else:
            loop.log.warning(
                "nbwatch could not find the Trainer: gradient norms are read after its "
                "clipping and the emergency checkpoint is off; use nbwatch.hf.start(trainer)")

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._rec() is None:
            return
        host = {"epoch": float(state.epoch)} if state.epoch is not None else {}
        self._at_boundary = True  # the commands are applied (and pause blocks) in here
        try:
            stop = self._record_step(
                host, "the Trainer's loss, mean over accumulation micro-batches")
        finally:
            self._at_boundary = False
        if stop:
            control.should_training_stop = True  # stopped between two optimizer steps
            self._save_reason = "stop"
        if self._saved_step == state.global_step:  # nbwatch saved this step already
            self._save_reason = None  # (a stop's checkpoint is that one)
            if not control.should_evaluate:  # else the Trainer's save follows its eval
                control.should_save = False
        if self._save_reason is not None:
            control.should_save = True
        self._agree_lr()
        rec = self._rec()
        if control.should_save and rec is not None:  # the Trainer saves next: the store
            rec.commit()  # must not lag behind it

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        rec = self._rec()
        if control.should_save and rec is not None:  # save_strategy="epoch": the Trainer
            rec.commit()  # saves next, and the store must not lag behind it

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None,
                    eval_dataloader: Any = None, model: Any = None, **kw: Any) -> None:
        rec = self._rec()
        if rec is None or not metrics or rec.ended:
            return
        if (rec.spec.probe_batch is None and rec.spec.attention_samples > 0
                and eval_dataloader is not None and model is not None):
            rec.set_probe(batch=_probe_batch(eval_dataloader, model,
                                             rec.spec.attention_samples))
        rec.evaluate(eval_figures(metrics, val_set(args, getattr(self.trainer, "eval_dataset",
                                                                  None))))

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        rec = self._rec()
        if rec is None:
            return
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        reason, self._save_reason = self._save_reason or "periodic (Trainer)", None
        t0, self._save_t0 = self._save_t0, None
        took = time.perf_counter() - t0 if t0 is not None else None
        rec.note_checkpoint(reason, path, took, best=state.best_model_checkpoint == str(path))

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._ends_here():  # a script: the callback alone ends the run
            self._end(None)

    # -- nbwatch's side -----------------------------------------------------------------
    def _save(self, reason: str) -> None:
        """The recorder's checkpoints, the Trainer's way."""
        rec, trainer = self._rec(), self.trainer
        # Ctrl-C in the foreground fit of the callback alone: no step end comes, where the
        # Trainer would save a stop's checkpoint, so it is written now, as an error's is
        interrupted = reason == "stop" and self._interrupted
        if interrupted and trainer is not None and rec is not None:
            self._interrupted = False
            step = self.monitor.step if self.monitor is not None else None
            if trainer.state.global_step != step:  # its optimizer had stepped
                rec.note(f"interrupted between the optimizer's step and the Trainer's step "
                         f"end: no checkpoint (the weights are step {step}'s, the Trainer's "
                         f"state step {trainer.state.global_step}'s)")
                return
        elif reason in ("final", "stop", "periodic"):
            return  # the Trainer's save strategy; a stop asks for one at its step
        if (reason == "emergency" or interrupted) and trainer is not None and rec is not None:
            # a rank died (or went silent): the Trainer's own save takes collectives
            alone = (reason == "emergency" and trainer.args.world_size > 1  # (a peer to lose)
                     and self._raised_by is not None and lost_peer(self._raised_by))
            if alone and not trainer.args.should_save:  # rank 0 (or its node's) died: its
                # rank's RNG state alone would make a checkpoint-N that resumes nothing
                rec.log.info("no emergency checkpoint: the rank that saves is lost")
                return
            try:  # the fit raised: the Trainer will not reach its own save
                rec.note_checkpoint(reason, save_checkpoint_now(trainer, alone=alone))
            except Exception as e:  # noqa: BLE001 - the original failure matters more
                rec.note(f"{reason} checkpoint at step {trainer.state.global_step} "
                         f"failed: {type(e).__name__}: {str(e)[:300]}")
            return
        if self._at_boundary and self.trainer is not None and rec is not None:
            self._save_now(reason)  # now: a paused fit goes no further until Resume
            return
        self._save_reason = reason  # on_step_end sets control.should_save

    def _save_now(self, reason: str) -> None:
        """Write the Trainer's checkpoint of the step just taken, now, between two
        optimizer steps (where the Trainer itself saves), and tell every callback as the
        Trainer does (`on_save`: ours records the checkpoint event). Under a pause it is
        on disk, resumable with `train(resume_from_checkpoint=...)`, while the fit waits."""
        trainer, rec = self.trainer, self._rec()
        assert trainer is not None and rec is not None  # the caller checked both
        step = trainer.state.global_step
        if self._saved_step == step:
            rec.log.info("the checkpoint of step %d is written already", step)
            return
        self._agree_lr()  # an LR cut taken with it: the scheduler's state says so too
        self._save_reason, self._save_t0 = reason, time.perf_counter()
        try:
            save_checkpoint_now(trainer, announce=True)
        except BaseException as e:
            self._save_reason = self._save_t0 = None
            self._raised(e)  # the fit fails with it (a full disk), its run too
            raise
        self._saved_step = step

    def _agree_lr(self) -> None:
        """After an LR cut, the scheduler's last LR (what the Trainer logs as
        `learning_rate`, and so what W&B or TensorBoard record beside nbwatch) reads the
        LR the optimizer uses next, factor included, not the bare schedule."""
        rec = self._rec()
        lrs = rec.next_lrs() if rec is not None else None
        if rec is not None and lrs is not None:
            set_last_lr(rec.scheduler, lrs)

    def _wrap(self, trainer: Trainer) -> None:
        """See each micro-batch's loss and mask, and measure before the Trainer clips.

        The Trainer passes no exception to its callbacks: its public methods that a fit
        runs through (data, forward and backward, eval) are guarded here, so that one that
        raises ends the callback's own run at once, as failed, and its store, sampler and
        writer lock do not outlive the fit (start()'s thread sees the exception itself)."""
        step = trainer.training_step

        def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            rec = self._rec()
            if rec is not None:  # which batch: its ids' hash where they are on the CPU
                rec.note_batch(inputs)
            loss = step(model, inputs, *args, **kwargs)
            if isinstance(loss, torch.Tensor):
                with rec.own if rec is not None else contextlib.nullcontext():
                    self._losses.append(loss.detach())
            self._note_logit_mask(model, inputs)  # (and looks if it is an encoder-decoder)
            # a batch in parts (a collator's {"chosen": ..., "rejected": ...}): each part's
            # tokens, the batch's own rows (`loader_batches`, as start()'s and Lightning's)
            split = loader_batches(inputs, bool(self._enc_dec and self._enc_dec[1]))
            # a packed part's tokens are all real; an encoder-decoder's: its source's
            self._note_batch(inputs, split, [None if packed_positions(p) is not None
                                             else input_tokens(p) for p in split.parts])
            return loss

        def before_clip(found_inf: torch.Tensor | None = None) -> torch.Tensor | float | None:
            rec = self._rec()  # pre-clip norms, and the skip / clip rules of nbwatch: the
            # Trainer logs the norm before nbwatch's clip, not after it
            return rec.measure(found_inf) if rec is not None else None

        trainer.training_step = training_step  # type: ignore[method-assign]  # this instance's
        wrap_clip_grad_norm(trainer, before_clip)
        names = ["training_step", *_GUARDED, *PRIVATE_STEPS]
        for name in names:
            fn = getattr(trainer, name, None)
            if callable(fn):
                setattr(trainer, name, self._guarded(fn))
        self._wrapped = (trainer, names)

    def _guarded(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                self._raised(e)
                raise
        return guarded

    def _raised(self, error: BaseException) -> None:
        trainer, loop, mon = self.trainer, self._rec(), self.monitor
        self._raised_by = error
        if (trainer is not None and loop is not None and mon is not None
                and retries_at_smaller_batch(trainer, error)):
            # the Trainer begins the fit again at a smaller batch: end this try (as failed,
            # should it give up) without the emergency checkpoint a retry has no use for
            self._retry = _Retry(trainer, train_batch_size(trainer), mon.step,
                                 f"{type(error).__name__}: {str(error)[:200]}")
            self._unwrap()
            loop.abandon(error)
            if self._ends_here():
                self._fitting, self._owner = False, None
            return
        if self._ends_here():
            self._interrupted = isinstance(error, (KeyboardInterrupt, Terminated))
            self._end(error)

    def _unwrap(self) -> None:
        if self._wrapped is not None:
            trainer, names = self._wrapped
            for name in names:
                trainer.__dict__.pop(name, None)
        self._wrapped = None

    def _forget(self) -> None:
        super()._forget()
        self.trainer, self._save_reason = None, None
        self._saved_step, self._save_t0 = None, None
        self._at_boundary = self._interrupted = False  # a Ctrl-C is its fit's alone
        self._raised_by = None

    def _close_unseen(self) -> None:
        self._unwrap()
        super()._close_unseen()

    def _end(self, error: BaseException | None) -> None:
        self._unwrap()
        super()._end(error)


def start(trainer: Trainer, run_dir: str | os.PathLike | None = None, *,
          config: dict[str, Any] | None = None, display: bool | None = None,
          monitor: dict[str, Any] | None = None, **train_kwargs: Any) -> FitRun:
    """Run `trainer.train(**train_kwargs)` in a background thread, recorded into `run_dir`;
    return at once (in a notebook, the dashboard shows). `monitor`: keyword arguments of
    the callback (alerts, probe_batch, …). Returns a handle with the Monitor's controls."""
    api = "nbwatch.hf.start"
    if not isinstance(trainer, Trainer):
        raise TypeError(f"{api} takes a transformers.Trainer, got {type(trainer).__name__}")
    check_fit_arguments(api, trainer.train, (), train_kwargs, NbwatchCallback.TAKEN)
    found = list({id(c): c for c in trainer.callback_handler.callbacks
                  if isinstance(c, NbwatchCallback)}.values())
    for c in found:  # one callback added twice records once
        _drop_repeats(trainer, c)
    cb, new = callback_of(found, lambda: NbwatchCallback(run_dir, config, **(monitor or {})),
                          api=api, detach="trainer.remove_callback(cb)", run_dir=run_dir,
                          config=config, monitor=monitor)
    cb._prepare(api, trainer, bool(train_kwargs.get("resume_from_checkpoint")), _RESUME)
    if new:
        trainer.add_callback(cb)

    def fit() -> Any:
        try:
            return trainer.train(**train_kwargs)
        finally:
            if new:  # start()'s callback records this fit only
                trainer.remove_callback(cb)

    return cb._launch(api, trainer, fit, display)


def _drop_repeats(trainer: Trainer | None, cb: NbwatchCallback) -> None:
    """One registration of `cb` in the Trainer's callbacks (`drop_repeats`)."""
    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", None)
    drop_repeats(callbacks, cb, "Trainer", "trainer.remove_callback(cb)")


def val_set(args: Any, eval_dataset: Any) -> str | None:
    """Of an `eval_dataset` dict, the set whose loss is the run's `loss/val` (its gap, its
    val alerts, its best checkpoint): the one `metric_for_best_model` names
    (`eval_<set>_…`), else the first. None for one eval set."""
    if not isinstance(eval_dataset, Mapping) or not eval_dataset:
        return None
    best = (getattr(args, "metric_for_best_model", None) or "").removeprefix("eval_")
    return next((s for s in eval_dataset if best.startswith(f"{s}_")), next(iter(eval_dataset)))


def eval_figures(metrics: Mapping[str, Any], val: str | None = None) -> dict[str, float]:
    """The Trainer's eval metrics as nbwatch's: `eval_loss` → `loss`, `eval_x` → `x`
    (recorded as `loss/val` and `val/x`); timings and the epoch left out, those of each
    set of an `eval_dataset` dict too (`eval_<set>_runtime`); that set's loss also as
    `loss` where it is `val` (`val_set`)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        name = k.removeprefix("eval_")
        if isinstance(v, bool) or any(name == n or name.endswith(f"_{n}")
                                      for n in _NOT_METRICS):
            continue
        try:
            x = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(x) or name == "loss":
            out[name] = x
    if val is not None and f"{val}_loss" in out:
        out["loss"] = out[f"{val}_loss"]
    return out


def probe_forward(model: Any, batch: Any) -> Any:
    """The attention probe's pass of a Hugging Face model: `model(**batch)`; eager
    attention returns its weights only when asked (`output_attentions=True`), SDPA's are
    recomputed from q and k by the probe itself."""
    eager = attention_implementation(model) == "eager"
    if isinstance(batch, Mapping):
        return model(**batch, output_attentions=True) if eager else model(**batch)
    return model(batch)


def _probe_batch(loader: Any, model: Any, n: int) -> Any:
    """The first `n` samples of the first eval batch, on the model's device."""
    batch = take_samples(next(iter(loader)), n)
    device = next(model.parameters()).device
    if isinstance(batch, Mapping):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch
