"""What nbwatch takes from transformers beyond its callbacks and public methods: the one
place it reaches into the Trainer. tests/test_adapters.py checks each of these against the
installed transformers, so that a release that changes one fails there by name."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .base import found_inf

# The Trainer's own steps an error passes through, guarded so that it is recorded as the
# run's: its clip of the gradients, and its loop over one epoch's steps (transformers'
# `_inner_training_loop` calls it each epoch, after on_train_begin: an error anywhere in a
# step, the optimizer's, the scheduler's, the Trainer's save, another callback's, passes
# through it). Absent in a transformers that has no such method: nothing is wrapped then.
PRIVATE_STEPS = ("_clip_grad_norm", "_run_epoch")


def calling_trainer() -> Trainer | None:
    """The Trainer whose method calls us now, e.g. a callback's event (callbacks get no
    reference to it): the innermost `self` on the stack that is a Trainer. Takes
    `sys._getframe`."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        f = f.f_back
    return None


def wrap_clip_grad_norm(trainer: Trainer, before: Callable[..., Any]) -> None:
    """Call `before()` each time `trainer` is about to clip its gradients: after the
    optimizer step's backward, before the clipping and the step itself (the Trainer has no
    callback there). What `before()` returns, where not None, is the norm the Trainer logs
    as `grad_norm` (the norm before nbwatch's own clip, which the Trainer's would measure
    after it). Takes `Trainer._clip_grad_norm(model)`, replaced on this instance only
    (deleting the instance attribute restores it)."""
    clip = trainer._clip_grad_norm

    def clip_grad_norm(model: Any) -> Any:
        acc: Any = getattr(trainer, "accelerator", None)
        if getattr(acc, "scaler", None) is None:
            norm = before()
            theirs = clip(model)
            return theirs if norm is None else norm
        # fp16: the gradients are still scaled here (the clip unscales them first): unscale
        # them now, so that nbwatch measures (and clips) the true ones, and let the clip's
        # own unscale pass (a second GradScaler.unscale_ raises)
        own = "unscale_gradients" in vars(acc)
        unscale = acc.unscale_gradients
        unscale()
        acc.unscale_gradients = lambda *a, **k: None
        try:
            norm = before(found_inf(acc.scaler, trainer.optimizer))
            theirs = clip(model)
            return theirs if norm is None else norm
        finally:
            if own:
                acc.unscale_gradients = unscale
            else:
                del acc.unscale_gradients

    trainer._clip_grad_norm = clip_grad_norm  # type: ignore[method-assign]  # this instance's


def save_checkpoint_now(trainer: Trainer, announce: bool = False,
                        alone: bool = False) -> Path:
    """Write the Trainer's own checkpoint of its current step now, outside its save
    strategy (a Checkpoint click, maybe under a pause; the fit raised, so the Trainer will
    not reach its save); returns its folder, which `train(resume_from_checkpoint=...)`
    takes. `announce`: then tell the callbacks, as the Trainer does after its own save
    (`trainer.control = trainer.callback_handler.on_save(...)`). `alone`: another rank
    died, so no collective is taken: under DDP the Trainer's FLOs sum over the ranks
    (`store_flos`, an all_gather that a closed connection fails at once and a silent rank
    holds for the process group's timeout) becomes this rank's own, and the barrier before
    its best checkpoint's check is skipped (the best one stays as it was); the weights are
    every rank's. Takes `Trainer._save_checkpoint(model, trial)`, `Trainer.store_flos`,
    `TrainerState.current_flos`/`total_flos`/`best_global_step`."""
    model, output_dir = trainer.model, trainer.args.output_dir
    assert model is not None and output_dir is not None  # a Trainer that fits has both
    best = trainer.state.best_global_step
    if alone:
        trainer.store_flos = lambda: _own_flos(trainer)  # type: ignore[method-assign]
        trainer.state.best_global_step = None
    try:
        trainer._save_checkpoint(model, trial=None)
    finally:
        if alone:
            trainer.__dict__.pop("store_flos", None)
            trainer.state.best_global_step = best
    path = Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    if alone and best is not None and trainer.args.should_save:  # its state as it is
        trainer.state.save_to_json(str(path / TRAINER_STATE_NAME))  # (not the None above)
    if announce:
        trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state,
                                                           trainer.control)
    return path


def _own_flos(trainer: Trainer) -> None:
    """`Trainer.store_flos` without its sum over the ranks: this rank's count alone."""
    trainer.state.total_flos += trainer.current_flos
    trainer.current_flos = 0


def set_last_lr(scheduler: Any, lrs: list[Any]) -> None:
    """Make `scheduler.get_last_lr()` read `lrs`. The Trainer logs it as `learning_rate`
    (read after the optimizer step, before `scheduler.step()`: the LR that step used), so
    set to the optimizer's LRs after a cut it logs the cut LR; `scheduler.step()` sets it
    anew from the optimizer, and the schedule itself (`base_lrs`, `last_epoch`) is
    untouched. Takes torch's `LRScheduler._last_lr` (what `get_last_lr()` returns); a
    scheduler without one is left as it is."""
    if isinstance(getattr(scheduler, "_last_lr", None), list):
        scheduler._last_lr = list(lrs)


def attention_implementation(model: Any) -> str | None:
    """'eager', 'sdpa', … of a Hugging Face model (eager alone returns its attention
    weights when asked). Takes `PretrainedConfig._attn_implementation`."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def train_batch_size(trainer: Any) -> int | None:
    """The batch size the Trainer's fit uses now (`auto_find_batch_size` lowers it after an
    out-of-memory error, then begins the fit again). Takes `Trainer._train_batch_size`."""
    size = getattr(trainer, "_train_batch_size", None)
    return size if isinstance(size, int) else None


def retries_at_smaller_batch(trainer: Trainer, error: BaseException) -> bool:
    """The Trainer answers `error` with a new fit from step 0 at a smaller batch: an
    out-of-memory error under `auto_find_batch_size` (accelerate's own test of it)."""
    if not getattr(trainer.args, "auto_find_batch_size", False):
        return False
    try:
        from accelerate.utils.memory import should_reduce_batch_size  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - the Trainer needs accelerate for it
        return False
    return isinstance(error, Exception) and bool(should_reduce_batch_size(error))
