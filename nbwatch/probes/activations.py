"""The residual stream's size after each block, and the output logits, on the probe pass.

Blocks are the entries of every `nn.ModuleList` of two or more modules of one class
(`transformer.h.3`, `model.layers.11`, `encoder.layer.0`): forward hooks, installed only
for the pass, read each block's output (a tensor, or the first tensor of a tuple).

The output logits come from what the probe's forward returned, else from what the model
itself returned (a forward hook on it: a `step_fn` that returns only the loss still runs
the model), else from the output layer's output (`get_output_embeddings()` of a Hugging
Face model, else the last `nn.Linear` onto the vocabulary, the largest `nn.Embedding`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .paths import unwrapped


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of the repeated blocks, in depth order."""
    out = []
    for name, mod in unwrapped(model).named_modules():
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


def _is_logits(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2 \
        and x.shape[-1] > 1


def named_logits(out: Any) -> torch.Tensor | None:
    """The logits a forward's output names (`.logits`, `out["logits"]`), else None."""
    x = getattr(out, "logits", None)
    if x is None and isinstance(out, Mapping):
        x = out.get("logits")
    return x if _is_logits(x) else None


def output_logits(out: Any) -> torch.Tensor | None:
    """The logits a forward returned: `.logits` (Hugging Face), `out["logits"]`, the output
    itself when it is a float tensor [..., vocab] (not a scalar loss), or the first such
    tensor of a tuple (`logits, loss = model(idx, targets)`)."""
    x = named_logits(out)
    if x is None and isinstance(out, torch.Tensor):
        x = out
    if x is None and isinstance(out, (tuple, list)):
        x = next((t for t in out if _is_logits(t)), None)
    return x if _is_logits(x) else None


def output_layer(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(path, module) of the layer that makes the output logits: the outermost Hugging Face
    model's `get_output_embeddings()`, else the last `nn.Linear` whose outputs are the
    vocabulary (the `out_features` of the largest `nn.Embedding`); None when neither."""
    found = output_layers(model)
    return found[-1] if found else None


def output_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face model's `get_output_embeddings()`, alone; else the
    `nn.Linear`s onto the vocabulary, in order (a model holding two nets, a student and a
    frozen teacher, has one each: which one trains shows only when it runs).

    Onto the vocabulary: a Linear tied to an embedding (nanoGPT's `lm_head`); else onto as
    many features as the largest `nn.Embedding` has rows, the least deep in indexed blocks
    (a char-level model as wide as its vocabulary, d = V, has such Linears in each block);
    else, outside a Hugging Face model, onto a smaller embedding's rows from outside the
    blocks (learned positions outnumbering a char-level vocabulary: 256 against 65)."""
    model = unwrapped(model)
    paths = {id(m): n for n, m in model.named_modules()}
    hf = False
    for _, mod in model.named_modules():
        get = getattr(mod, "get_output_embeddings", None)
        if callable(get):
            hf = True
            try:
                head = get()
            except Exception:  # a model that declares it but does not implement it
                head = None
            if isinstance(head, nn.Module) and id(head) in paths:
                return [(paths[id(head)], head)]
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    linears: list[tuple[str, nn.Module]] = [
        (n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    tied = {id(m.weight) for m in embeddings}
    if found := [(n, m) for n, m in linears if id(m.weight) in tied]:
        return found
    sizes = sorted({m.num_embeddings for m in embeddings if m.num_embeddings > 1},
                   reverse=True)
    for i, vocab in enumerate(sizes if not hf else sizes[:1]):
        found = [(n, m) for n, m in linears if getattr(m, "out_features", 0) == vocab]
        least = min((_indexed(n) for n, _ in found), default=0)
        found = [(n, m) for n, m in found if _indexed(n) == least]
        if found and (i == 0 or least == 0):
            return found
    return []


def _indexed(path: str) -> int:
    """How many indexed containers (a ModuleList's, a Sequential's) a module's path is in."""
    return sum(part.isdigit() for part in path.split(".")[:-1])


class Outputs:
    """What the model and its output layer returned on the probe pass (first call each)."""

    def __init__(self) -> None:
        self.model: Any = None
        self.head: Any = None
        self.head_path: str | None = None

    def logits(self, returned: Any) -> tuple[torch.Tensor | None, str | None]:
        """(logits, where they came from): the probe forward's `returned` value first,
        then the model's own output, then the output layer's."""
        for x, where in ((returned, "the probe forward's result"),
                         (self.model, "the model's output"),
                         (self.head, f"the output layer {self.head_path}")):
            got = output_logits(x)
            if got is not None:
                return got, where
        return None, None


@contextmanager
def capture_outputs(model: nn.Module) -> Iterator[Outputs]:
    """Within the block, what `model` and its output layer (`output_layer`) return, for the
    logits a probe forward that returns only a loss does not hand back."""
    got = Outputs()
    found = output_layer(model)
    handles = []

    def on_model(mod: nn.Module, args: Any, out: Any) -> None:
        if got.model is None:
            got.model = out

    def on_head(mod: nn.Module, args: Any, out: Any) -> None:
        if got.head is None:
            got.head = out

    handles.append(model.register_forward_hook(on_model))
    if found is not None:
        got.head_path = found[0] or "(the model)"
        handles.append(found[1].register_forward_hook(on_head))
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def logit_figures(logits: torch.Tensor) -> dict[str, float]:
    """The LM head's health: the mean log-partition log Σ exp(logit) (what z-loss pulls to
    0) and the largest |logit|."""
    x = logits.detach().float()
    return {"logits/z_mean": float(torch.logsumexp(x, dim=-1).mean()),
            "logits/max_abs": float(x.abs().max())}
