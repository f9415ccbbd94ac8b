"""Gradient accumulation in a loop of one's own: the step's loss that `log()` records.

`mon.log(loss=[l1, ..., lk])` hands over each micro-batch's loss (as computed, before the
`/ k` that scales its backward): `loss/train` is their mean, on the device, copied with
the step's other figures, as `start(accumulate=k)` and the Trainer record it. One loss
tensor is recorded as given; where the step took several backward passes (counted by a
hook on one trained weight, host-side) and that tensor is one forward's loss (its graph
joins no other loss), it is one micro-batch's loss, and `log()` says so once a run: the
last micro-batch's instead of the step's mean, `k`× too small where it was divided by `k`.
A float, or a tensor without a graph (a running total of detached losses), may be the
step's mean already: it is recorded as given, and nothing is said."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

# Nodes a loss passes through on its way from one forward to the value handed over, where
# each has one input that takes a gradient (a divisor, a mask, a scale take none).
_THROUGH = {"DivBackward0", "DivBackward1", "MulBackward0", "MulBackward1", "MeanBackward0",
            "SumBackward0", "ViewBackward0", "ReshapeAliasBackward0", "SqueezeBackward0",
            "SqueezeBackward1", "UnsqueezeBackward0", "ToCopyBackward0", "CloneBackward0",
            "AliasBackward0", "AddBackward1", "SubBackward1", "NegBackward0"}
_JOINS = {"StackBackward0", "CatBackward0"}  # several losses made one (torch.stack(ls))


class BackwardCount:
    """Backward passes that reach one trained weight (a post-accumulate-grad hook: one
    Python call per backward, no tensor read) between two optimizer steps, outside the
    step itself (LBFGS's closure); `take()` gives those of the step just taken (none
    where the optimizer did not step: a GradScaler's skip)."""

    def __init__(self, params: list[torch.nn.Parameter], inside: Callable[[], bool]):
        self._n = 0  # since the last optimizer step
        self._step = 0  # those of the step just taken, until `take()`
        self._inside = inside
        self._unhook: Any = None  # the hook's removal, run once: by remove() or at collection
        param = next((p for p in params if p.requires_grad), None)
        hook = getattr(param, "register_post_accumulate_grad_hook", None)
        if hook is None:  # no trained weight: nothing counted, nothing said
            return
        ref = weakref.ref(self)  # the weight must not keep the Monitor alive

        def counted(_: torch.Tensor) -> None:
            me = ref()
            if me is not None and not me._inside():
                me._n += 1

        # removed when this is collected (the Monitor and its optimizer dropped: a cell run
        # again on the same model), not left one a Monitor on the weight for ever
        self._unhook = weakref.finalize(self, hook(counted).remove)

    def stepped(self) -> None:
        """The optimizer's pre-hook: the passes so far are this step's."""
        self._step, self._n = self._n, 0

    def take(self) -> int:
        """At the loop's `log()`: the passes since the last optimizer step are a step not
        taken (a GradScaler's skip), dropped, not lent to the next step."""
        n, self._step, self._n = self._step, 0, 0
        return n

    def remove(self) -> None:
        if self._unhook is not None:
            self._unhook()


def step_mean(parts: list[torch.Tensor], numbers: list[float]) -> Any:
    """The mean of the micro-batches' losses `log(loss=[...])` got (`parts`: the tensors',
    0-dim, checked; `numbers`: the others'): a 0-dim tensor on the first accelerator
    tensor's device (the host's where none is on one), or a float where all are numbers.
    Nothing crosses to the device from the host: a CPU tensor is read there (free) and
    the numbers are added as one Python scalar (a `torch.tensor(v, device=...)` or a CPU
    tensor's `.to(device)` is a pageable copy, which on CUDA waits for the stream: every
    queued kernel)."""
    dev = next((p.device for p in parts if p.device.type != "cpu"), None)
    n = len(parts) + len(numbers)
    if dev is None:  # all on the host: one tensor still, read with the step's figures
        if not parts:
            return sum(numbers) / n
        return (torch.stack([p.float() for p in parts]).sum() + sum(numbers)) / n
    host = [float(p) for p in parts if p.device.type == "cpu"] + list(numbers)
    on = [p.float().to(dev) for p in parts if p.device.type != "cpu"]  # device to device
    total = torch.stack(on).sum() if len(on) > 1 else on[0]
    return (total + sum(host)) / n if n > 1 else total


def one_of_many(loss: Any, backwards: int) -> str | None:
    """What to say where one forward's loss tensor stands for a step of `backwards` ≥ 2
    backward passes; None where it may be the step's own (a list, a float, a tensor
    without a graph, or one whose graph joins several losses)."""
    if backwards < 2 or not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
        return None
    fn: Any = loss.grad_fn
    for _ in range(16):
        inputs = [n for n, _ in fn.next_functions if n is not None]
        if len(inputs) > 1 or fn.name() in _JOINS:
            return None  # several losses made one: sum(ls) / k, torch.stack(ls).mean()
        if fn.name() not in _THROUGH or not inputs:
            return _said(backwards)  # the forward's own loss (NLL, MSE, a model's)
        fn = inputs[0]
    return None


def _said(k: int) -> str:
    ls = ", ".join(f"l{i}" for i in range(1, min(k, 3) + 1)) + (", ..." if k > 3 else "")
    return (
        f"loss/train: mon.log(loss=...) got one forward's loss, but {k} backward passes made "
        f"this step's gradients (gradient accumulation): it is recorded as given, the last "
        f"micro-batch's loss, not the step's mean, and {k}x too small if it is the "
        f"loss / {k} that was backpropagated. Hand over each micro-batch's loss as computed, "
        f"before dividing by {k}: mon.log(loss=[{ls}]) records their mean (as start(..., "
        f"accumulate={k}) and the Trainer do), or log their mean yourself "
        f"(sum(l.detach() for l in losses) / {k}). If this loss is the step's own (its "
        f"{k} backward passes took one batch: SAM), hand over loss.detach() and this is "
        f"not said")
