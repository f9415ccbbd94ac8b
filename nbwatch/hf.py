"""Hugging Face `Trainer`: watch and steer `trainer.train()` with one line.

    mon = nbwatch.hf.start(trainer, run_dir="runs/hf")      # in a notebook: returns at once
    Trainer(..., callbacks=[nbwatch.hf.NbwatchCallback(run_dir="runs/hf")])   # in a script

Built on the step recorder of `Monitor.log()`: the gradient figures are taken at the
Trainer's own step (before its clipping), and the controls act through the Trainer's own
mechanisms: stop sets `control.should_training_stop`, checkpoint sets
`control.should_save` (a `checkpoint-N` folder that `train(resume_from_checkpoint=...)`
takes), pause blocks between optimizer steps, clip and cut LR act from the next step.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    from transformers import Trainer, TrainerCallback
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError(
        "nbwatch.hf needs the transformers package: pip install 'nbwatch[hf]'") from None

import torch

from .fit import Adapter, FitRun, unwrap
from .monitor import Monitor
from .probes.attention import take_samples

__all__ = ["NbwatchCallback", "start"]
SUPPORTED = "transformers 4.46 – 5.x (tested with 5.24)"
_NOT_METRICS = ("runtime", "samples_per_second", "steps_per_second", "epoch")


class NbwatchCallback(Adapter, TrainerCallback):
    """Records every optimizer step of a `Trainer` into `run_dir`, and takes the controls.

    Keyword arguments are the Monitor's: `config` (stored beside the TrainingArguments),
    `name`, `alerts`, `on_alert`, `probe_batch` (default: the first samples of the first
    eval batch), `attention_samples`, `hist_every`, `rank_every`, `dist_timeout`.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None,
                 config: dict[str, Any] | None = None, **monitor_kwargs: Any):
        super().__init__(run_dir, config, **monitor_kwargs)
        self.trainer: Trainer | None = None
        self._save_reason: str | None = None
        self._wrapped: list[str] = []

    # -- the Trainer's events -----------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.trainer = self.trainer or _find_trainer()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kw: Any) -> None:
        trainer = self.trainer = self.trainer or _find_trainer()
        opt = unwrap(optimizer, "optimizer")
        sched = unwrap(lr_scheduler, "scheduler")
        if not callable(getattr(sched, "step", None)) or isinstance(
                sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched = None
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        kwargs = {"display": False, "probe_fn": probe_forward, **self.monitor_kwargs}
        config = {"trainer": args.to_sanitized_dict(), **self.config}
        mon = Monitor(model, opt, sched, self.run_dir, config, scaler=scaler,
                      max_steps=state.max_steps or None, **kwargs)
        self._adopt(mon)
        rec = mon._open_loop(start_step=state.global_step or None, framework="hf")
        rec.save_fn = self._save
        rec.framework_clip = args.max_grad_norm or None
        if trainer is not None:
            self._wrap(trainer)
        else:
            mon._recorder.log.warning(
                "nbwatch could not find the Trainer: gradient norms are read after its "
                "clipping and the emergency checkpoint is off; use nbwatch.hf.start(trainer)")

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._rec() is None:
            return
        host = {"epoch": float(state.epoch)} if state.epoch is not None else {}
        if self._record_step(host, "the Trainer's loss, mean over accumulation micro-batches"):
            control.should_training_stop = True  # stopped between two optimizer steps
            self._save_reason = "stop"
        if self._save_reason is not None:
            control.should_save = True
        if control.should_save:  # the Trainer saves next: the store must not lag behind it
            self._rec().commit()

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None,
                    eval_dataloader: Any = None, model: Any = None, **kw: Any) -> None:
        rec = self._rec()
        if rec is None or not metrics or rec.ended:
            return
        if (rec.spec.probe_batch is None and rec.spec.attention_samples > 0
                and eval_dataloader is not None and model is not None):
            rec.spec.probe_batch = _probe_batch(eval_dataloader, model,
                                                rec.spec.attention_samples)
        rec.evaluate(eval_figures(metrics))

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        rec = self._rec()
        if rec is None:
            return
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        reason, self._save_reason = self._save_reason or "periodic (Trainer)", None
        rec.note_checkpoint(reason, path, best=state.best_model_checkpoint == str(path))

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.handle is None:  # a script: the callback alone ends the run
            self._end(None)

    # -- nbwatch's side -----------------------------------------------------------------
    def _save(self, reason: str) -> None:
        """The recorder's checkpoints, the Trainer's way."""
        if reason in ("final", "stop") or reason == "periodic":
            return  # the Trainer's save strategy; a stop asks for one at its step
        rec = self._rec()
        if reason == "emergency" and self.trainer is not None and rec is not None:
            try:  # the fit raised: the Trainer will not reach its own save
                self.trainer._save_checkpoint(self.trainer.model, trial=None)
                path = Path(self.trainer.args.output_dir) / \
                    f"checkpoint-{self.trainer.state.global_step}"
                rec.note_checkpoint(reason, path)
            except Exception as e:  # noqa: BLE001 - the original failure matters more
                rec.log.warning("emergency checkpoint failed: %s", e)
            return
        self._save_reason = reason  # on_step_end sets control.should_save

    def _wrap(self, trainer: Trainer) -> None:
        """See each micro-batch's loss and mask, and measure before the Trainer clips."""
        step, clip = trainer.training_step, trainer._clip_grad_norm

        def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            rec = self._rec()
            if rec is not None:  # which batch: its ids' hash where they are on the CPU
                rec.note_batch(inputs)
            loss = step(model, inputs, *args, **kwargs)
            if isinstance(loss, torch.Tensor):
                self._losses.append(loss.detach())
            if isinstance(inputs, Mapping) and isinstance(inputs.get("attention_mask"),
                                                          torch.Tensor):
                self._masks.append(inputs["attention_mask"])
            return loss

        def clip_grad_norm(model: Any) -> Any:
            rec = self._rec()
            if rec is not None:
                rec.pre_step()  # pre-clip norms, and the skip / clip rules of nbwatch
            return clip(model)

        trainer.training_step = training_step
        trainer._clip_grad_norm = clip_grad_norm
        self._wrapped = ["training_step", "_clip_grad_norm"]

    def _unwrap(self) -> None:
        if self.trainer is not None:
            for name in self._wrapped:
                self.trainer.__dict__.pop(name, None)
        self._wrapped = []

    def _end(self, error: BaseException | None) -> None:
        self._unwrap()
        super()._end(error)


def start(trainer: Trainer, run_dir: str | os.PathLike | None = None, *,
          config: dict[str, Any] | None = None, display: bool | None = None,
          monitor: dict[str, Any] | None = None, **train_kwargs: Any) -> FitRun:
    """Run `trainer.train(**train_kwargs)` in a background thread, recorded into `run_dir`;
    return at once (in a notebook, the dashboard shows). `monitor`: keyword arguments of
    the callback (alerts, probe_batch, …). Returns a handle with the Monitor's controls."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"nbwatch.hf.start takes a transformers.Trainer, got "
                        f"{type(trainer).__name__}")
    cbs = [c for c in trainer.callback_handler.callbacks if isinstance(c, NbwatchCallback)]
    cb = cbs[0] if cbs else NbwatchCallback(run_dir, config, **(monitor or {}))
    if not cbs:
        trainer.add_callback(cb)
    cb.trainer = trainer
    return cb._launch(lambda: trainer.train(**train_kwargs), display)


def eval_figures(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The Trainer's eval metrics as nbwatch's: `eval_loss` → `loss`, `eval_x` → `x`
    (recorded as `loss/val` and `val/x`); timings and the epoch left out."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        name = k.removeprefix("eval_")
        if name in _NOT_METRICS or isinstance(v, bool):
            continue
        try:
            x = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(x) or name == "loss":
            out[name] = x
    return out


def probe_forward(model: Any, batch: Any) -> Any:
    """The attention probe's pass of a Hugging Face model: `model(**batch)`; eager
    attention returns its weights only when asked (`output_attentions=True`), SDPA's are
    recomputed from q and k by the probe itself."""
    config = getattr(model, "config", None)
    eager = getattr(config, "_attn_implementation", None) == "eager"
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


def _find_trainer() -> Trainer | None:
    """The Trainer calling this callback (callbacks get no reference to it)."""
    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        f = f.f_back
    return None
