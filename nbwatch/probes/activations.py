"""The residual stream's size after each block, and the output logits, on the probe pass.

Blocks are the entries of every `nn.ModuleList` of two or more modules of one class
(`transformer.h.3`, `model.layers.11`, `encoder.layer.0`): forward hooks, installed only
for the pass, read each block's output (a tensor, or the first tensor of a tuple).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of the repeated blocks, in depth order."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({type(m) for m in mod}) == 1:
            out += [(f"{name}.{i}" if name else str(i), m) for i, m in enumerate(mod)]
    return out


@contextmanager
def capture_block_rms(model: nn.Module, samples: int = 2) -> Iterator[dict[str, float]]:
    """Within the block, {block path: RMS of its output over the first `samples` rows}."""
    rms: dict[str, float] = {}
    handles = []

    def hook(path: str):
        def read(mod: nn.Module, args: Any, out: Any) -> None:
            x = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
                rms[path] = float(x.detach()[:samples].float().pow(2).mean().sqrt())
        return read

    for path, mod in blocks(model):
        handles.append(mod.register_forward_hook(hook(path)))
    try:
        yield rms
    finally:
        for h in handles:
            h.remove()


def output_logits(out: Any) -> torch.Tensor | None:
    """The logits a forward returned: `.logits` (Hugging Face), `out["logits"]`, or the
    output itself when it is a float tensor [..., vocab] (not a scalar loss)."""
    x = getattr(out, "logits", None)
    if x is None and isinstance(out, dict):
        x = out.get("logits")
    if x is None and isinstance(out, torch.Tensor):
        x = out
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2 \
            and x.shape[-1] > 1:
        return x
    return None


def logit_figures(logits: torch.Tensor) -> dict[str, float]:
    """The LM head's health: the mean log-partition log Σ exp(logit) (what z-loss pulls to
    0) and the largest |logit|."""
    x = logits.detach().float()
    return {"logits/z_mean": float(torch.logsumexp(x, dim=-1).mean()),
            "logits/max_abs": float(x.abs().max())}
