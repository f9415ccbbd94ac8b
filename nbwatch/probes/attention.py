"""Attention maps of a few probe samples, captured without changing the model.

Fused attention never materialises its weights, so they are recomputed on a separate,
gradient-free probe pass (at eval time, never on a training step):

* `F.scaled_dot_product_attention` (nanoGPT, Hugging Face "sdpa"): a TorchFunctionMode
  sees every call, however the function was imported, and recomputes
  softmax(QKᵀ·scale + mask) from the captured q and k; the calling module is the
  innermost module whose forward is running.
* `nn.MultiheadAttention`: a forward pre-hook asks for per-head weights
  (`need_weights=True, average_attn_weights=False`), and MHA's fused fast path, which
  skips the module's Python forward (`nn.TransformerEncoderLayer` in eval mode), is
  switched off for the pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .paths import unwrapped


def sdpa_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The pre-softmax attention logits [..., H, T, S] of `F.scaled_dot_product_attention`
    (QKᵀ·scale + mask), masked positions at −inf."""
    q, k = q.float(), k.float()
    if k.shape[-3:-2] != q.shape[-3:-2] and q.dim() >= 3 and (enable_gqa or k.dim() == q.dim()):
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    t, s = scores.shape[-2:]
    if is_causal:
        causal = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    return scores


def sdpa_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The attention weights [..., H, T, S] that `F.scaled_dot_product_attention` applies."""
    scores = sdpa_scores(q, k, attn_mask, is_causal, scale, enable_gqa)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0


def head_entropy(w: torch.Tensor) -> torch.Tensor:
    """[B, H, T, S] weights → [H]: each head's row entropy in nats, averaged over the rows
    that attend (sum ~1; padded and fully masked rows sum to 0) of every sample."""
    w = w.float()
    live = w.sum(-1) > 0.5  # [B, H, T]
    ent = -(w * torch.log(w.clamp_min(1e-12))).sum(-1)
    n = live.sum(dim=(0, 2))
    return torch.where(n > 0, (ent * live).sum(dim=(0, 2)) / n.clamp_min(1),
                       torch.full_like(n, float("nan"), dtype=torch.float32))


def head_max_logit(scores: torch.Tensor) -> torch.Tensor:
    """[B, H, T, S] pre-softmax logits → [H]: each head's largest logit at a position that
    is not masked (masks are −inf, or the dtype's minimum added)."""
    x = scores.float()
    floor = torch.finfo(scores.dtype).min / 2 if scores.is_floating_point() else -1e30
    x = torch.where(torch.isfinite(x) & (x > floor), x, torch.full_like(x, float("-inf")))
    m = x.amax(dim=(0, 2, 3))
    return torch.where(torch.isfinite(m), m, torch.full_like(m, float("nan")))


def mha_scores(mod: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
               attn_mask: torch.Tensor | None = None,
               key_padding_mask: torch.Tensor | None = None,
               is_causal: bool = False) -> torch.Tensor | None:
    """The pre-softmax logits [B, H, T, S] of an `nn.MultiheadAttention` call, recomputed
    from its input projections (masked positions at −inf; None for the rare variants
    with bias_k or add_zero_attn)."""
    if mod.bias_k is not None or mod.add_zero_attn:
        return None
    if mod._qkv_same_embed_dim:
        wq, wk, _ = mod.in_proj_weight.chunk(3)
    else:
        wq, wk = mod.q_proj_weight, mod.k_proj_weight
    bq, bk = mod.in_proj_bias.chunk(3)[:2] if mod.in_proj_bias is not None else (None, None)
    if query.dim() == 2:  # unbatched
        query, key = query.unsqueeze(1 - mod.batch_first), key.unsqueeze(1 - mod.batch_first)
    if not mod.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    q, k = F.linear(query, wq, bq).float(), F.linear(key, wk, bk).float()
    (b, t, _), s, h = q.shape, k.shape[1], mod.num_heads
    q = q.view(b, t, h, -1).transpose(1, 2)
    k = k.view(b, s, h, -1).transpose(1, 2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if is_causal and attn_mask is None:
        attn_mask = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(1)
    if attn_mask is not None:  # MHA's convention: True = may NOT attend
        m = attn_mask.view(b, h, t, s) if attn_mask.dim() == 3 else attn_mask
        scores = (scores.masked_fill(m, float("-inf")) if m.dtype == torch.bool
                  else scores + m.float())
    if key_padding_mask is not None:
        pad = key_padding_mask.view(b, 1, 1, s)
        scores = (scores.masked_fill(pad, float("-inf")) if pad.dtype == torch.bool
                  else scores + pad.float())
    return scores


class Captured(dict[str, torch.Tensor]):
    """{module path: weights [samples, heads, T, S]} (cropped), and per head of each module
    its attention entropy and largest pre-softmax logit on the probe samples, uncropped
    (`entropy`, `max_logit`: {module path: [heads]})."""

    def __init__(self) -> None:
        super().__init__()
        self.entropy: dict[str, np.ndarray] = {}
        self.max_logit: dict[str, np.ndarray] = {}


_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax)


class _SDPAMode(TorchFunctionMode):
    """Sees every `F.scaled_dot_product_attention` call (`on_call`) and every softmax over
    the last dim of a 3-d or 4-d float tensor (`on_softmax`: eager attention's logits)."""

    def __init__(self, on_call: Callable[[tuple, dict], None],
                 on_softmax: Callable[[torch.Tensor], None] | None = None):
        super().__init__()
        self.on_call = on_call
        self.on_softmax = on_softmax

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.on_call(args, kwargs)
        elif func in _SOFTMAX and self.on_softmax is not None and args:
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() in (3, 4)
                    and dim in (-1, x.dim() - 1)):
                self.on_softmax(x)
        return func(*args, **kwargs)


def _sdpa_args(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


@contextmanager
def _mha_fastpath_off() -> Iterator[None]:
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    was = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(was)


@contextmanager
def capture_attention(
    model: nn.Module, samples: int = 2, max_tokens: int = 64
) -> Iterator[Captured]:
    """Within the block, record attention maps of every attention module that runs.

    Yields a `Captured` dict filled on exit's way in: {module path: weights [samples, heads,
    T, S]}, cropped to the first `max_tokens` queries and keys, with each head's entropy and
    largest logit beside it. Every hook is removed on exit.
    """
    captured = Captured()
    model = unwrapped(model)  # a DDP wrapper calls these modules: named, hooked as alone
    names = {m: n for n, m in model.named_modules()}
    stack: list[str] = []
    handles = []

    def keep(path: str, w: torch.Tensor) -> None:
        w = w.detach()[:samples]
        key, i = path, 1
        while key in captured:  # a module called twice in one pass
            i += 1
            key = f"{path}#{i}"
        captured.entropy[key] = head_entropy(w).cpu().numpy()
        captured[key] = w[..., :max_tokens, :max_tokens].float().cpu()

    def keep_logits(path: str, scores: torch.Tensor) -> None:
        m = head_max_logit(scores.detach()[:samples]).cpu().numpy()
        was = captured.max_logit.get(path)
        captured.max_logit[path] = m if was is None or was.shape != m.shape else np.fmax(was, m)

    def on_softmax(x: torch.Tensor) -> None:
        if stack and x.dim() == 4:
            keep_logits(stack[-1], x)

    def push(mod: nn.Module, *_: Any) -> None:
        stack.append(names.get(mod, "?"))

    def pop(mod: nn.Module, *_: Any) -> None:
        if stack:
            stack.pop()

    def mha_pre(mod: nn.MultiheadAttention, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        scores = mha_scores(mod, *args[:2], **{k: v for k, v in kwargs.items()
                                                 if k in ("attn_mask", "key_padding_mask",
                                                          "is_causal")})
        if scores is not None:
            keep_logits(names[mod], scores)
        kwargs = dict(kwargs, need_weights=True, average_attn_weights=False)
        return args, kwargs

    def mha_post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if isinstance(out, tuple) and len(out) > 1 and out[1] is not None:
            w = out[1]
            if w.dim() == 3:  # unbatched input: [heads, T, S]
                w = w.unsqueeze(0)
            keep(names[mod], w)

    def on_sdpa(args: tuple, kwargs: dict) -> None:
        a = _sdpa_args(args, kwargs)
        if not isinstance(a.get("query"), torch.Tensor) or a["query"].dim() < 3:
            return
        scores = sdpa_scores(
            a["query"][:samples],
            a["key"][:samples],
            a["attn_mask"][:samples]
            if isinstance(a.get("attn_mask"), torch.Tensor) and a["attn_mask"].dim() == 4
            else a.get("attn_mask"),
            bool(a.get("is_causal", False)),
            a.get("scale"),
            bool(a.get("enable_gqa", False)),
        )
        if scores.dim() == 3:
            scores = scores.unsqueeze(0)
        path = stack[-1] if stack else "(root)"
        keep_logits(path, scores)
        keep(path, torch.softmax(scores, dim=-1).nan_to_num(0.0))

    returned: dict[str, torch.Tensor] = {}

    def weights_out(mod: nn.Module, args: tuple, out: Any) -> None:
        # eager attention (Hugging Face with output_attentions=True) returns its weights
        # beside its output: (output, weights) or (output, position_bias, weights)
        if not isinstance(out, tuple):
            return
        for w in out[1:]:
            if _looks_like_attention(w):
                returned[names.get(mod, "?")] = w[:samples]
                return

    for mod in model.modules():
        handles.append(mod.register_forward_pre_hook(push))
        handles.append(mod.register_forward_hook(pop))
        if not isinstance(mod, nn.MultiheadAttention):
            handles.append(mod.register_forward_hook(weights_out))
        if isinstance(mod, nn.MultiheadAttention):
            handles.append(mod.register_forward_pre_hook(mha_pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(mha_post, with_kwargs=True))
    try:
        with _mha_fastpath_off(), _SDPAMode(on_sdpa, on_softmax), torch.no_grad():
            yield captured
    finally:
        for h in handles:
            h.remove()
        if not captured:  # no fused call seen: weights the modules returned themselves
            for path, w in returned.items():  # the innermost module that returned them
                if not any(p.startswith(path + ".") for p in returned):
                    keep(path, w)


def has_attention(model: nn.Module) -> bool:
    """Whether any module looks like attention: an `nn.MultiheadAttention`, or one whose
    class or name says attention (`attn`, `attention`, flash-attn's `MHA`, `MultiHead…`).
    A CNN, an MLP or an RNN has none."""
    for name, mod in unwrapped(model).named_modules():
        words = (type(mod).__name__ + " " + name.rsplit(".", 1)[-1]).lower()
        if isinstance(mod, nn.MultiheadAttention) or any(
                w in words for w in ("attn", "attention", "mha", "multihead")):
            return True
    return False


def _looks_like_attention(w: Any) -> bool:
    """[B, H, T, S], non-negative, each row summing to 1 (or 0 where fully masked), and
    some row summing to 1: T5's all-zero position bias, returned beside the weights, is
    not attention."""
    if not (isinstance(w, torch.Tensor) and w.dim() == 4 and w.is_floating_point()):
        return False
    rows = w.float().sum(-1)
    ones = (rows - 1).abs() < 1e-3
    return bool(w.min() >= 0) and bool(ones.any()) and bool((ones | (rows.abs() < 1e-6)).all())


def clone_samples(batch: Any, n: int) -> Any:
    """`take_samples`, copied: the probe keeps them while the loader reuses its buffers."""
    return _map_tensors(take_samples(batch, n), torch.Tensor.clone)


def _map_tensors(obj: Any, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(v, fn) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def take_samples(batch: Any, n: int) -> Any:
    """The first `n` samples of a batch: tensors sliced on dim 0, containers recursed."""
    return _map_tensors(batch, lambda t: t[:n] if t.dim() > 0 else t)
