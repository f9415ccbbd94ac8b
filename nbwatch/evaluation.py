"""What happens at an eval step: val_fn, the attention probe, sample_fn.

`evaluate` runs them in eval mode without gradients and returns plain results; the
runner records them, feeds the alert rules and checkpoints.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from . import health
from .probes.activations import capture_block_rms, logit_figures, output_logits
from .probes.attention import capture_attention
from .records import Attention


@dataclass
class EvalResult:
    # loss/val, val/<k>, time/eval; the probe pass's health figures (attn/, logits/, act/)
    values: dict[str, float] = field(default_factory=dict)
    attention: list[Attention] = field(default_factory=list)
    sample: str | None = None
    probe_error: str | None = None  # the default probe forward did not fit the model

    def first_maps(self) -> dict[str, np.ndarray]:
        """{module: [heads, T, S]} of the first probe sample (what the rules look at)."""
        return {a.module: a.weights for a in self.attention if a.sample == 0}


def val_figures(v: Any) -> dict[str, float]:
    """`val_fn`'s float or dict as scalar names: `loss` → `loss/val`, others → `val/<k>`."""
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, (int, float)):
        return {"loss/val": float(v)}
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            x = float(x.item() if isinstance(x, torch.Tensor) else x)
            out["loss/val" if k in ("loss", "loss/val") else f"val/{k}"] = x
        return out
    raise TypeError(f"val_fn returned a {type(v).__name__}; return a float or a dict of floats")


@contextmanager
def _eager_weights_returned(model: nn.Module) -> Iterator[None]:
    """Hugging Face eager attention returns its weights only when asked: ask, for the
    probe pass (`config.output_attentions`), then restore."""
    config = getattr(model, "config", None)
    eager = getattr(config, "_attn_implementation", None) == "eager"
    was = getattr(config, "output_attentions", None)
    if eager:
        config.output_attentions = True
    try:
        yield
    finally:
        if eager:
            config.output_attentions = was


def probe_forward(model: nn.Module, batch: Any) -> Any:
    """The probe pass of a loop nbwatch does not run: `model(**batch)` for a dict,
    `model(x)` for a tensor, `model(batch[0])` for a tuple or list."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(batch[0])
    return model(batch)


def evaluate(model: nn.Module, spec: Any, step: int, train_loss: float | None,
             val: Any = None) -> EvalResult:
    """Run the eval-time callbacks of `spec` (a RunSpec) on `model`, then restore its mode.

    `val` is the val figure(s) a loop of the user's own computed (then `val_fn` is not
    called). `loss/gap` is val loss minus `train_loss`, the smoothed train loss now.
    """
    out = EvalResult()
    was_training = model.training
    model.eval()
    try:
        if val is not None:
            out.values.update(val_figures(val))
        elif spec.val_fn is not None:
            t0 = time.perf_counter()
            with torch.no_grad():
                out.values.update(val_figures(spec.val_fn(model)))
            out.values["time/eval"] = time.perf_counter() - t0
        if "loss/val" in out.values and train_loss is not None:
            out.values["loss/gap"] = out.values["loss/val"] - train_loss
        if spec.probe_batch is not None and spec.attention_samples > 0:
            forward = spec.probe_fn or spec.step_fn
            # torch.compile: probe the module it wraps, so Dynamo never traces the hooks
            target = getattr(model, "_orig_mod", model)
            returned = None
            with capture_attention(target, spec.attention_samples,
                                   spec.attention_tokens) as maps, torch.no_grad(), \
                    _eager_weights_returned(target), \
                    capture_block_rms(target, spec.attention_samples) as rms:
                if forward is not None:
                    returned = forward(target, spec.probe_batch)
                else:
                    try:
                        returned = probe_forward(target, spec.probe_batch)
                    except Exception as e:  # a guess at the model's signature: say so
                        out.probe_error = (
                            f"the attention probe's forward failed ({type(e).__name__}: "
                            f"{str(e)[:200]}); pass probe_fn=lambda model, batch: ... to "
                            "nbwatch.Monitor to say how the model takes probe_batch")
            if not maps and out.probe_error is None:
                out.probe_error = (
                    "the attention probe saw no attention weights (no "
                    "F.scaled_dot_product_attention, nn.MultiheadAttention or attention "
                    "module returning its weights ran); attention maps are off for this run")
            logits = output_logits(returned)
            out.values.update(health.figures(
                maps.entropy, maps.max_logit, rms,
                logit_figures(logits) if logits is not None else {}))
            for module, w in maps.items():
                for i in range(w.shape[0]):
                    toks = None
                    if spec.probe_tokens and i < len(spec.probe_tokens):
                        toks = tuple(spec.probe_tokens[i][: w.shape[-1]])
                    out.attention.append(Attention(step, module, i, w[i].numpy(), toks))
        if spec.sample_fn is not None:
            with torch.no_grad():
                out.sample = str(spec.sample_fn(model))
    finally:
        model.train(was_training)
    return out
