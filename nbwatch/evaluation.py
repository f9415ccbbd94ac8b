"""What happens at an eval step: val_fn, the attention probe, sample_fn.

`evaluate` runs them in eval mode without gradients and returns plain results; the
runner records them, feeds the alert rules and checkpoints.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from .alerts import health
from .counts import real
from .probes.activations import (
    capture_block_rms,
    capture_outputs,
    logit_figures,
    output_layer,
)
from .probes.attention import capture_attention, has_attention
from .records import Attention
from .samples import capped_text


@dataclass
class EvalResult:
    # loss/val, val/<k>, time/eval; the probe pass's health figures (attn/, logits/, act/)
    values: dict[str, float] = field(default_factory=dict)
    attention: list[Attention] = field(default_factory=list)
    sample: Any = None  # what sample_fn returned (nbwatch.samples makes it storable)
    probe_error: str | None = None  # the default probe forward did not fit the model
    probe_severity: str = "warning"  # "info": a model without attention layers, as expected
    # {figures: why} the probe pass could not take on this model ("logits"), with the line
    # to add; the probe stays on, and the recorder says each once a run
    probe_notes: dict[str, str] = field(default_factory=dict)
    probe_note_severity: dict[str, str] = field(default_factory=dict)  # "info" unless here

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


_VAL_SOURCES = {  # who gave the val figures: (prefix, name, what it may be)
    "log": ("mon.log(): ", "val", "pass the val loss (a real number or a one-element real "
            "tensor) or a dict of val figures, e.g. mon.log(loss=loss, val={'loss': 2.31, "
            "'accuracy': 0.41})"),
    "val_fn": ("", "val_fn()", "return the val loss (a real number or a one-element real "
               "tensor) or a dict of val figures, e.g. return {'loss': 2.31, 'accuracy': 0.41}"),
}


def check_val(val: Any, source: Literal["log", "val_fn"] = "log") -> Any:
    """The val figures of `log(val=...)` (`source` "log") or of `val_fn` ("val_fn"): the val
    loss (a real number or one-element tensor) or a dict of val figures named by str
    ('loss' is the val loss); returned with numbers as floats."""
    if val is None:
        return None
    prefix, name, how = _VAL_SOURCES[source]
    items = val.items() if isinstance(val, dict) else [(None, val)]
    if isinstance(val, dict) and not val:
        raise ValueError(f"{prefix}{name} is an empty dict; {how}")
    for k, v in items:
        what = name if k is None else f"{name}[{k!r}]"
        if k is not None and not isinstance(k, str):
            raise TypeError(f"{prefix}{name}'s key {k!r} is a {type(k).__name__}; name each "
                            f"val figure by a str; {how}")
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ValueError(f"{prefix}{what} has shape {tuple(v.shape)}, not one "
                                 f"value: reduce it first (e.g. .mean()); {how}")
            if v.is_complex():
                raise TypeError(f"{prefix}{what} is a complex tensor ({v.dtype}); {how}")
        elif isinstance(v, np.ndarray) and v.size == 1 and v.dtype.kind in "iuf":
            pass  # a one-element numpy value, as float() takes it (log()'s scalars too)
        elif not real(v):
            raise TypeError(f"{prefix}{what} is a {type(v).__name__} ({short_repr(v)}); {how}")
    if isinstance(val, dict):
        return {k: v if isinstance(v, torch.Tensor) else float(v) for k, v in val.items()}
    return val if isinstance(val, torch.Tensor) else float(val)


def short_repr(v: Any) -> str:
    """repr(v), cut to 60 characters for a message."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _sample(sample_fn: Callable[[nn.Module], Any], model: nn.Module, step: int) -> Any:
    """What `sample_fn(model)` returned (text capped); its error, raised as sample_fn's."""
    try:
        with torch.no_grad():
            got = sample_fn(model)
    except Exception as e:
        raise RuntimeError(f"sample_fn raised at the eval of step {step}: "
                           f"{type(e).__name__}: {e}; fix sample_fn, or start() without "
                           "it") from e
    return capped_text(got) if isinstance(got, str) else got


# the attention implementations whose weights the probe sees: eager returns them when asked
# (output_attentions), SDPA's are recomputed from its q and k (probes/attention.py)
_SEEN = ("eager", "sdpa")


@contextmanager
def _weights_returned(model: nn.Module) -> Iterator[None]:
    """Hugging Face attention, for the probe pass, in a form whose weights the probe sees,
    then as it was: a kernel that gives none (flash_attention_2/3, flex_attention, one
    registered with AttentionInterface) runs as SDPA (eager where the model has no SDPA),
    unless its class was chosen for it at init, and eager attention returns its weights
    (`config.output_attentions` of every eager model in the tree: a Lightning module's
    inner `self.model` too)."""
    configs: dict[int, Any] = {}
    for mod in model.modules():
        config = getattr(mod, "config", None)
        if config is not None and isinstance(getattr(config, "_attn_implementation", None), str):
            configs.setdefault(id(config), config)
    # a kernel class chosen at the model's init (transformers before 4.48's FlashAttention2
    # classes, GPT-Neo's and Bark's still) stays whatever the config says, and the mask
    # the model builds for SDPA or eager would reach it (4-D where flash reads [batch, T]:
    # indices past the keys, a device-side assert): those run as they are, unseen
    fixed = any(hasattr(m, "_flash_attn_uses_top_left_mask") for m in model.modules())
    kernels = {id(c): c._attn_implementation for c in configs.values()
               if c._attn_implementation not in _SEEN and not fixed}
    sdpa = all(getattr(m, "_supports_sdpa", True) is not False for m in model.modules()
               if isinstance(m, nn.Module) and hasattr(m, "_supports_sdpa"))
    for key in kernels:
        configs[key]._attn_implementation_internal = "sdpa" if sdpa else "eager"
    eager = {key: getattr(c, "output_attentions", None) for key, c in configs.items()
             if c._attn_implementation == "eager"}
    for key in eager:
        configs[key].output_attentions = True
    try:
        yield
    finally:
        for key, was in eager.items():
            configs[key].output_attentions = was
        for key, impl in kernels.items():  # each config as it was (not its sub-configs')
            configs[key]._attn_implementation_internal = impl


def batch_call(module: nn.Module, batch: Any) -> tuple[tuple, dict[str, Any]]:
    """The arguments a guessed probe forward gives `module` for `batch`: a dict's entries
    that its forward names (`input_ids`, `attention_mask`, `labels`, ...), all of them when
    it names none but takes `**kwargs`, else the dict's `input_ids` (or its first tensor)
    as the one positional argument; `x` for a tensor; `batch[0]` for a tuple or list."""
    if isinstance(batch, Mapping):
        try:
            params = inspect.signature(module.forward).parameters.values()
        except (TypeError, ValueError):  # no signature to read: pass everything
            return (), dict(batch)
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        picked = {k: v for k, v in batch.items() if k in named}
        if picked:
            return (), picked
        if any(p.kind == p.VAR_KEYWORD for p in params):
            return (), dict(batch)
        first = batch.get("input_ids")
        if first is None:
            first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        return ((first,) if first is not None else ()), {}
    if isinstance(batch, (list, tuple)):
        return (batch[0],), {}
    return (batch,), {}


def describe_call(name: str, batch: Any, module: nn.Module) -> str:
    """`batch_call(module, batch)` as the line a user would write: `model(**batch)`,
    `module.model(input_ids=batch["input_ids"], ...)`, `model(batch[0])`."""
    args, kwargs = batch_call(module, batch)
    if isinstance(batch, Mapping):
        if kwargs and len(kwargs) == len(batch):
            return f"{name}(**batch)"
        if kwargs:
            return f"{name}(" + ", ".join(f'{k}=batch["{k}"]' for k in kwargs) + ")"
        key = next((k for k, v in batch.items() if v is args[0]), None) if args else None
        return f'{name}(batch["{key}"])' if key is not None else f"{name}()"
    return f"{name}(batch[0])" if isinstance(batch, (list, tuple)) else f"{name}(batch)"


def probe_forward(model: nn.Module, batch: Any) -> Any:
    """The probe pass of a loop nbwatch does not run: `model(**batch)` for a dict (the
    entries its forward names), `model(x)` for a tensor, `model(batch[0])` for a tuple or
    list (`batch_call`)."""
    args, kwargs = batch_call(model, batch)
    return model(*args, **kwargs)


@dataclass
class GuessedForward:
    """A probe forward nbwatch chose (not the user's `probe_fn`): should it fail, the probe
    is turned off with the exact line to add, and training goes on.

    `what`: the call, as the user would write it (`module.model(**batch)`); `fix`: how this
    entry point takes a probe_fn, with `{fn}` where the function goes
    (`NbwatchCallback(probe_fn={fn})`)."""

    fn: Callable[[nn.Module, Any], Any]
    what: str
    fix: str
    arg: str = "model"  # what the user calls the probed module in a lambda

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        return self.fn(model, batch)

    def fix_with(self, body: str) -> str:
        return self.fix.format(fn=f"lambda {self.arg}, batch: {body}")


def _guess(spec: Any, model: nn.Module) -> GuessedForward | None:
    """The forward nbwatch chose for the probe (a loop of the user's own, an adapter's
    choice); None when it is the user's probe_fn or step_fn."""
    if isinstance(spec.probe_fn, GuessedForward):
        return spec.probe_fn
    if spec.probe_fn is None and spec.step_fn is None:
        return GuessedForward(probe_forward, describe_call("model", spec.probe_batch, model),
                              "pass nbwatch.Monitor(..., probe_fn={fn})")
    return None


def _no_logits(spec: Any, guess: GuessedForward | None, model: nn.Module,
               own: Any = None) -> str:
    """The probe event of a pass that found no output logits: why, and the line to add;
    `own`: what the model itself returned. A Hugging Face model with no output layer onto
    a vocabulary whose output holds no `logits` (CLIP's `CLIPOutput`, a bare encoder's)
    has no LM logits to give: said, with no line to add (`.logits` would raise)."""
    off = ("logits/z_mean, logits/max_abs and the output_logit_drift rule are off for this "
           "run")
    hf = any(callable(getattr(m, "get_output_embeddings", None)) for m in model.modules())
    if hf and isinstance(own, Mapping) and "logits" not in own and output_layer(model) is None:
        fields = ", ".join(str(k) for k in own) or "nothing"
        return ("the probe pass found no output logits: the model has no language-model "
                "head (no output layer onto a vocabulary) and its output, "
                f"{type(own).__name__} ({fields}), has no `logits`, so {off} (they watch a "
                "language model's logits over its vocabulary; nothing to add)")
    msg = ("the probe pass found no output logits (not in what its forward returned, nor in "
           "the model's output, nor at an output layer: get_output_embeddings(), lm_head or "
           f"a Linear onto the vocabulary), so {off}: ")
    call = guess.what if guess is not None else "model(**batch)"
    body = f"{call}.logits" if hf else f"<the logits of {call}>"
    if guess is not None:
        return msg + guess.fix_with(body)
    if spec.probe_fn is not None:
        return msg + f"return them from probe_fn (probe_fn=lambda model, batch: {body})"
    return msg + ('return them from step_fn (return {"loss": out.loss, "logits": out.logits}) '
                  f"or pass start(..., probe_fn=lambda model, batch: {body})")


def _user_forward(forward: Callable[[nn.Module, Any], Any], model: nn.Module, spec: Any,
                  step: int) -> Any:
    """The probe pass through the user's `probe_fn`, else `step_fn`; its error names which
    one raised, so a `step_fn` bug met first in the dry run's probe is not taken for val_fn's."""
    try:
        return forward(model, spec.probe_batch)
    except Exception as e:
        who = "probe_fn" if spec.probe_fn is not None else "step_fn"
        fix = ("fix probe_fn" if who == "probe_fn" else
               "fix step_fn (it runs here on probe_batch, in eval mode, without gradients), "
               "or give the probe the model's own forward: start(..., probe_fn=lambda model, "
               "batch: model(batch[\"input_ids\"]))")
        raise RuntimeError(f"the attention probe's forward, {who}(model, probe_batch), raised "
                           f"at the eval of step {step}: {type(e).__name__}: {e}; {fix}") from e


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
            try:
                with torch.no_grad():
                    got = spec.val_fn(model)
            except Exception as e:  # said as val_fn's, as sample_fn's is
                raise RuntimeError(f"val_fn raised at the eval of step {step}: "
                                   f"{type(e).__name__}: {e}") from e
            out.values.update(val_figures(check_val(got, "val_fn")))
            out.values["time/eval"] = time.perf_counter() - t0
        if "loss/val" in out.values and train_loss is not None:
            out.values["loss/gap"] = out.values["loss/val"] - train_loss
        if spec.probe_batch is not None and spec.attention_samples > 0:
            # torch.compile: probe the module it wraps, so Dynamo never traces the hooks
            target = getattr(model, "_orig_mod", model)
            guess = _guess(spec, target)
            forward = guess or spec.probe_fn or spec.step_fn
            returned = None
            with capture_attention(target, spec.attention_samples,
                                   spec.attention_tokens) as maps, torch.no_grad(), \
                    _weights_returned(target), \
                    capture_block_rms(target, spec.attention_samples) as rms, \
                    capture_outputs(target) as outputs:
                if guess is None:
                    returned = _user_forward(forward, target, spec, step)
                else:
                    try:
                        returned = forward(target, spec.probe_batch)
                    except Exception as e:  # a guess at the model's signature: say so
                        out.probe_error = (
                            f"the attention probe's forward {guess.what} failed "
                            f"({type(e).__name__}: {str(e)[:200]}); say how the model takes "
                            "the probe batch: " + guess.fix_with("..."))
            logits, _ = outputs.logits(returned)
            if not maps and out.probe_error is None and not has_attention(target):
                none = ("the attention probe saw no attention weights: the model has no "
                        "attention layer (no nn.MultiheadAttention, no module named attn or "
                        "attention)")
                if rms or (logits is not None and output_layer(target) is not None):
                    # a state-space LM (Mamba), an RNN LM: its residual stream, its logits
                    kept = ["the residual stream (act/rms/*)"] if rms else []
                    kept += ["the output logits (logits/*)"] if logits is not None else []
                    out.probe_notes["attention"] = (
                        f"{none}: no attention maps, attn/entropy or attn/max_logit for this "
                        f"run; the probe pass goes on for {' and '.join(kept)}")
                else:
                    out.probe_severity = "info"  # a CNN, an MLP, an RNN: nothing went wrong
                    out.probe_error = f"{none}; the probe is off for this run"
            elif not maps and out.probe_error is None:
                unseen = ("the attention probe saw no attention weights (no "
                          "F.scaled_dot_product_attention, nn.MultiheadAttention or attention "
                          "module returning its weights ran); attention maps are off for this "
                          "run")
                if rms or logits is not None:  # the pass goes on for what it does see
                    kept = ["the residual stream (act/rms/*)"] if rms else []
                    kept += ["the output logits (logits/*)"] if logits is not None else []
                    out.probe_notes["attention"] = (
                        f"{unseen}; the probe pass goes on for {' and '.join(kept)}")
                    out.probe_note_severity["attention"] = "warning"
                else:
                    out.probe_error = unseen
            if logits is None and out.probe_error is None:
                out.probe_notes["logits"] = _no_logits(spec, guess, target, outputs.model)
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
            out.sample = _sample(spec.sample_fn, model, step)
    finally:
        model.train(was_training)
    return out
