"""Lightning: watch and steer `trainer.fit(...)` with one line.

    mon = nbwatch.lightning.start(trainer, module, train_dataloaders=..., run_dir="runs/pl")
    L.Trainer(..., callbacks=[nbwatch.lightning.NbwatchCallback(run_dir="runs/pl")])

Built on the step recorder of `Monitor.log()`. Lightning runs backward inside
`optimizer.step(closure)`, so the gradient figures are taken at its
`on_before_optimizer_step` (after backward, before its clipping), not in the optimizer's
pre-hook. Stop sets `trainer.should_stop`; checkpoint is `trainer.save_checkpoint` (a
`.ckpt` that `fit(ckpt_path=...)` takes); pause blocks between optimizer steps.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.states import TrainerStatus
    from lightning.pytorch.utilities.exceptions import SIGTERMException
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError(
        "nbwatch.lightning needs the lightning package: pip install 'nbwatch[lightning]'"
    ) from None

import torch

from .. import controls as ctl
from ..evaluation import GuessedForward, batch_call, describe_call
from ..interrupts import Terminated
from ..monitor import Monitor
from ..probes.attention import take_samples
from ..probes.combined import loader_batches
from ..probes.data import additive_01, input_tokens, packed_positions
from .base import Adapter, callback_of, check_fit_arguments, drop_repeats, found_inf, unwrap
from .fit_run import FitRun

__all__ = ["NbwatchCallback", "start"]
SUPPORTED = "lightning 2.2 – 2.x (tested with 2.6)"
_MASK_KEYS = ("attention_mask", "mask")
_RESUME = "trainer.fit(..., ckpt_path=...)"


class NbwatchCallback(Adapter, pl.Callback):
    """Records every optimizer step of a Lightning fit into `run_dir`, and takes the
    controls. Keyword arguments are the Monitor's (`name`, `alerts`, `probe_batch`,
    `probe_fn`, `hist_every`, `rank_every`, …).

    One fit at a time: while its fit runs, another Trainer given the same callback is
    refused at its `fit()`; once that fit ended, the callback may record the next one
    (into the same run_dir: a continuation, `fit(..., ckpt_path=...)`)."""

    TAKEN = {"max_steps": "L.Trainer(max_steps=...)",
             "scaler": "Lightning's precision plugin's own GradScaler, found by nbwatch",
             "resume": "trainer.fit(..., ckpt_path=...) resumes the run too"}
    _unnoted = False  # Lightning saved a checkpoint its events do not hold yet

    # -- Lightning's events -------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        drop_repeats(getattr(trainer, "callbacks", None), self, "Trainer",
                     "trainer.callbacks.remove(cb) before fit()")
        self._begin("nbwatch.lightning", trainer, bool(trainer.global_step), _RESUME)
        self._steps_seen = trainer.global_step  # Lightning's count, which overflows move too
        self._unnoted, self._noted = False, set[tuple[str, int]]()  # its own saves
        if not trainer.optimizers:
            raise RuntimeError("nbwatch.lightning: the module configured no optimizer")
        if len(trainer.optimizers) > 1:
            raise RuntimeError(
                "nbwatch.lightning measures and steers one optimizer; this module configures "
                f"{len(trainer.optimizers)}: put their parameter groups in one optimizer "
                "where they train together; networks trained in turns (a GAN) need a loop "
                "of your own, with one nbwatch.Monitor per network and its optimizer")
        opt = trainer.optimizers[0]
        sched = None  # one stepped with the optimizer, else a ReduceLROnPlateau
        for cfg in trainer.lr_scheduler_configs:
            s = cfg.scheduler
            if sched is None or ctl.on_metric(sched):
                sched = s
        hparams = dict(pl_module.hparams) if getattr(pl_module, "hparams", None) else {}
        config = {"hparams": hparams, "max_steps": trainer.max_steps,
                  "max_epochs": trainer.max_epochs,
                  "accumulate_grad_batches": trainer.accumulate_grad_batches,
                  "precision": str(trainer.precision), **self.config}
        max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        kwargs = {"display": False, **self.monitor_kwargs}
        mon = Monitor(pl_module, opt, sched, self.run_dir, config, max_steps=max_steps,
                      **kwargs)
        clip = (trainer.gradient_clip_val or None
                if trainer.gradient_clip_algorithm in (None, "norm") else None)
        # measure_in_hook=False: the closure's backward runs inside optimizer.step
        loop = self._open(mon, "lightning", trainer.global_step or None,
                          save=lambda reason: self._save(trainer, reason), clip=clip,
                          measure_in_hook=False)
        # under torchrun, the straggler's clock: Lightning calls training_step through its
        # strategy's DDP wrapper (its forward redirected), whose buffer broadcast from rank
        # 0 is a wait for the slow rank before the module's forward (hooks off with the run)
        if isinstance(trainer.strategy.model, torch.nn.Module):
            loop.clock_forwards(trainer.strategy.model)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self._note_saves(trainer)
        rec = self._rec()
        if rec is not None:  # which batch; hashed only where it is on the CPU
            rec.note_batch(batch, trainer.current_epoch, batch_idx)
        self._note_logit_mask(pl_module, batch)  # (and looks if it is an encoder-decoder)
        # a CombinedLoader's batches (the fit's loaders a collection): each one's counted;
        # one batch's parts: each one's tokens, the batch's own samples
        split = loader_batches(batch, bool(self._enc_dec and self._enc_dec[1]),
                               trainer.train_dataloader)
        if len(split.parts) > 1:
            self._note_logit_mask(pl_module, split.parts[0])
        self._note_batch(batch, split, [_tokens(p) for p in split.parts])

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any,
                                 optimizer: Any) -> None:
        rec = self._rec()
        if rec is None:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(unwrap(optimizer, "optimizer"),
                                          "_step_supports_amp_scaling", False):
            # a fused optimizer: Lightning leaves its gradients scaled, and the scaler's
            # step unscales (and skips) inside the optimizer, whose pre-hook measures then
            rec.measure_in_optimizer_hook()
            return
        # after backward and a GradScaler's unscale, before clipping
        rec.measure(found_inf(scaler, optimizer))

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: Any,
                           checkpoint: dict[str, Any]) -> None:
        """Any checkpoint, Lightning's or ours: the store must not lag behind it."""
        rec = self._rec()
        if rec is not None:
            rec.commit()
            self._unnoted = True  # its path is known once the save returns

    def _note_saves(self, trainer: pl.Trainer) -> None:
        """Lightning's own checkpoints (its `ModelCheckpoint`s') saved since the last call,
        as checkpoint events: path, size, and whether it is the best so far."""
        rec = self._rec()
        if rec is None or not self._unnoted:
            return
        self._unnoted = False
        for cb in getattr(trainer, "checkpoint_callbacks", []):
            best, last = (str(getattr(cb, a, "") or "") for a in ("best_model_path",
                                                                    "last_model_path"))
            for path in dict.fromkeys([*map(str, getattr(cb, "best_k_models", {})), last]):
                p = Path(path)
                if not path or p.name.startswith("nbwatch-step=") or not p.exists():
                    continue
                seen = (path, p.stat().st_mtime_ns)  # last.ckpt is written over each time
                if seen in self._noted:
                    continue
                self._noted.add(seen)
                # a top-k's file may be deleted later, last.ckpt written over: a later
                # stop or checkpoint command writes its own rather than name either
                kept = getattr(cb, "save_top_k", 1) == -1 and path != last
                rec.note_checkpoint("Lightning", path, best=bool(
                    path == best and getattr(cb, "monitor", None)), kept=kept)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        rec = self._rec()
        if rec is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            with rec.own:
                self._losses.append(loss.detach())
        # an overflow's step: the GradScaler skipped optimizer.step(), Lightning counts it
        stepped, self._steps_seen = (rec.stepped or trainer.global_step > self._steps_seen,
                                     trainer.global_step)
        if not stepped:
            return  # accumulating: the optimizer steps at a later batch
        every, k = trainer.accumulate_grad_batches, len(self._losses)
        if k and not pl_module.automatic_optimization:  # each batch's own loss: their mean
            self._losses = [x / k for x in self._losses]
        elif 0 < k < every:  # an epoch's last, shorter step: each loss was divided by `every`
            self._losses = [x * (every / k) for x in self._losses]
        host = {"epoch": float(trainer.current_epoch)}
        if self._record_step(host, "training_step's loss, mean over accumulation micro-batches"):
            trainer.should_stop = True  # stopped between two optimizer steps
            self._save(trainer, "stop")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        rec = self._rec()
        if rec is None or trainer.sanity_checking or rec.ended:
            return
        val = val_figures(trainer.callback_metrics)
        if not val:
            return
        spec = rec.spec
        if spec.probe_batch is None and spec.attention_samples > 0:
            rec.set_probe(batch=_probe_batch(trainer, pl_module, spec.attention_samples))
        if spec.probe_fn is None and spec.probe_batch is not None and spec.attention_samples:
            found = probe_forward(pl_module, spec.probe_batch)
            if isinstance(found, str):
                rec.probe_failed(found)
            else:
                rec.set_probe(fn=found)
        rec.evaluate(val)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._note_saves(trainer)
        rec = self._rec()
        for cb in trainer.early_stopping_callbacks if trainer.should_stop else []:
            why = getattr(cb, "stopping_reason_message", None)  # lightning 2.5.1 on
            if rec is not None and (cb.stopped_epoch or why):  # `finished`, before its limit
                rec.note(f"Lightning's EarlyStopping ended the fit at step "
                         f"{trainer.global_step}: {why or cb.monitor}", "info")
        if self._ends_here():  # a script: the callback alone ends the run
            self._end(None)

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException
                     ) -> None:
        self._note_saves(trainer)
        if self._ends_here():  # not a refused fit of another Trainer sharing the callback
            self._end(exception)

    # -- nbwatch's side -----------------------------------------------------------------
    def _end(self, error: BaseException | None) -> None:
        """Lightning's answer to a SIGTERM (its `SignalConnector` raises `SIGTERMException`
        at a batch boundary, on every rank at the same one under DDP) is a stop, as a
        script's SIGTERM is: the run ends `stopped`, with a stop checkpoint that
        `fit(ckpt_path=...)` continues (a rank that died fails it at the ranks' last
        meeting instead). A SystemExit that read as a clean end, it was `finished`."""
        if isinstance(error, SIGTERMException):
            step = self.monitor.step if self.monitor is not None else 0
            error = Terminated(f"terminated by SIGTERM at step {step}")
        super()._end(error)

    def _save(self, trainer: pl.Trainer, reason: str) -> None:
        """The recorder's checkpoints, Lightning's way: `trainer.save_checkpoint`."""
        if reason in ("final", "periodic", "emergency"):
            return  # Lightning's own checkpointing; after a failure its state may be torn
        rec = self._rec()
        cb = trainer.checkpoint_callback
        folder = Path(getattr(cb, "dirpath", None) or Path(trainer.default_root_dir) /
                      "checkpoints")
        path = folder / f"nbwatch-step={trainer.global_step}.ckpt"
        t0 = time.perf_counter()
        trainer.save_checkpoint(path)  # every rank calls it; rank 0 writes
        if rec is not None:
            rec.note_checkpoint(reason, path, time.perf_counter() - t0)


def start(trainer: pl.Trainer, module: pl.LightningModule, *args: Any,
          run_dir: str | os.PathLike | None = None, config: dict[str, Any] | None = None,
          display: bool | None = None, monitor: dict[str, Any] | None = None,
          **fit_kwargs: Any) -> FitRun:
    """Run `trainer.fit(module, *args, **fit_kwargs)` in a background thread, recorded
    into `run_dir`; return at once (in a notebook, the dashboard shows)."""
    api = "nbwatch.lightning.start"
    if not isinstance(trainer, pl.Trainer):
        raise TypeError(f"{api} takes a lightning Trainer, got {type(trainer).__name__}")
    check_fit_arguments(api, trainer.fit, (module, *args), fit_kwargs,
                        NbwatchCallback.TAKEN)
    # ignore[attr-defined]: lightning sets `Trainer.callbacks` from its CallbackConnector
    # and declares no such attribute on the Trainer
    found = [c for c in trainer.callbacks  # type: ignore[attr-defined]
             if isinstance(c, NbwatchCallback)]
    cb, new = callback_of(found, lambda: NbwatchCallback(run_dir, config, **(monitor or {})),
                          api=api, detach="trainer.callbacks.remove(cb)", run_dir=run_dir,
                          config=config, monitor=monitor)
    if cb._fit_running():
        raise RuntimeError(cb._busy(api, trainer))
    if fit_running(trainer):
        raise RuntimeError(f"{api}: this Trainer is already fitting, without nbwatch (a "
                           "fit() in another thread): wait for it to end first")
    ckpt = fit_kwargs.get("ckpt_path", args[3] if len(args) > 3 else None)
    cb._prepare(api, trainer, ckpt is not None, _RESUME)
    if new:
        trainer.callbacks.append(cb)  # type: ignore[attr-defined]

    def fit() -> None:
        try:
            trainer.fit(module, *args, **fit_kwargs)
        finally:
            # start()'s callback records this fit only
            if new and cb in trainer.callbacks:  # type: ignore[attr-defined]
                trainer.callbacks.remove(cb)  # type: ignore[attr-defined]

    return cb._launch(api, trainer, fit, display)


def _tokens(batch: Any) -> torch.Tensor | None:
    """A batch's tokens: its `attention_mask` (its tokens, segment ids; not a model's own
    4-D [batch, 1, T, T] mask), else its `mask` (a float additive one as 0/1, else as it
    is: checked), else every `input_ids` token (an encoder-decoder's source's, never its
    target's), as the Trainer's; none for a packed batch (from its shape)."""
    if not isinstance(batch, Mapping):
        return None
    key = next((k for k in _MASK_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
    if key == "attention_mask":
        return input_tokens(batch)
    if key is not None:
        return additive_01(batch[key])
    return input_tokens(batch) if packed_positions(batch) is None else None


def val_figures(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Lightning's logged validation metrics: `val_loss`/`val/loss` → `loss`, `val_x` → `x`;
    several val dataloaders' `val_loss/dataloader_idx_N` each as it is, the first's also
    as `loss` (the run's `loss/val`)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        for prefix in ("val_", "val/", "validation_", "validation/", "eval_"):
            if k.startswith(prefix):
                name = k[len(prefix):]
                break
        else:
            continue
        try:
            out[name] = float(v)
        except (TypeError, ValueError):
            continue
    firsts = sorted((int(k.rpartition("_")[2]), k) for k in out
                    if k.startswith("loss/dataloader_idx_") and k.rpartition("_")[2].isdigit())
    if "loss" not in out and firsts:
        out["loss"] = out[firsts[0][1]]
    return out


_PROBE_FIX = ('NbwatchCallback(probe_fn={fn}), or nbwatch.lightning.start(..., '
              'monitor={{"probe_fn": {fn}}})')
# the attribute names users give the model a LightningModule wraps, in order of preference
_INNER = ("model", "net", "backbone", "transformer", "network", "encoder", "lm", "module")


def probe_forward(module: Any, batch: Any) -> GuessedForward | str:
    """How the probe pass calls a LightningModule without a `probe_fn`: its own forward, or,
    where it has none (its `training_step` calls `self.model(...)`), the inner model's;
    with the batch's entries that forward names (`batch_call`). A str, the exact line to
    add, where no forward can be found."""
    if type(module).forward is not pl.LightningModule.forward:
        return GuessedForward(_call(None), describe_call("module", batch, module), _PROBE_FIX,
                              "module")
    name, kids = inner_model(module)
    if name is not None:
        return GuessedForward(_call(name), describe_call(f"module.{name}", batch,
                                                         getattr(module, name)),
                              _PROBE_FIX, "module")
    example = f"module.{kids[0]}" if kids else "module.<your model>"
    arg = ('batch["input_ids"]' if isinstance(batch, Mapping) and "input_ids" in batch
           else "batch[0]" if isinstance(batch, (list, tuple)) else "batch")
    has = (f"several inner models ({', '.join(kids)})" if kids
           else "no inner model with parameters and a forward")
    return (f"the attention probe found no forward to call: {type(module).__name__} has no "
            f"forward() and {has}; attention maps and the health figures are off for this "
            "run. Say how the probe batch goes through the model: "
            + _PROBE_FIX.format(fn=f"lambda module, batch: {example}({arg})"))


def inner_model(module: Any) -> tuple[str | None, list[str]]:
    """(the attribute name of the model a forward-less LightningModule wraps, or None; the
    candidates): its one Hugging Face `PreTrainedModel` child, else its one child with
    parameters and a forward, else the first of those named model, net, backbone, ..."""
    kids = [(n, c) for n, c in module.named_children()
            if type(c).forward is not torch.nn.Module.forward
            and next(c.parameters(), None) is not None]
    names = [n for n, _ in kids]
    hf = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    pre = [n for n, c in kids if hf is not None and isinstance(c, hf)]
    if len(pre) == 1:
        return pre[0], names
    if len(kids) == 1:
        return names[0], names
    return next((n for n in _INNER if n in names), None), names


def _call(name: str | None) -> Any:
    def forward(module: Any, batch: Any) -> Any:
        inner = module if name is None else getattr(module, name)
        args, kwargs = batch_call(inner, batch)
        return inner(*args, **kwargs)
    return forward


def _probe_batch(trainer: pl.Trainer, module: Any, n: int) -> Any:
    loaders = trainer.val_dataloaders
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    if loaders is None:
        return None
    batch = take_samples(next(iter(loaders)), n)
    return module.transfer_batch_to_device(batch, module.device, 0) if hasattr(
        module, "transfer_batch_to_device") else batch


# -- what we take from Lightning beyond its callbacks -----------------------------------
# Nothing private: the Trainer's public properties (optimizers, lr_scheduler_configs,
# gradient_clip_val, checkpoint_callback, save_checkpoint, should_stop, callback_metrics,
# val_dataloaders), the documented `SIGTERMException` its loops raise after a SIGTERM, and
# the one below. tests/test_adapters.py checks it against the installed Lightning, so that
# a release that changes it fails there by name.

def fit_running(trainer: pl.Trainer) -> bool:
    """A fit (or validate, test, predict) of `trainer` runs now, in some thread. Takes
    `Trainer.state.status` and `TrainerStatus.RUNNING`."""
    return trainer.state.status == TrainerStatus.RUNNING
