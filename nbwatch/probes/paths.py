"""Module paths as the model itself names them: a (Distributed)DataParallel wrapper's
`module.` left out, so that a run under torchrun names its layers, blocks and attention
modules as the same model trained alone does (its checkpoints hold the same keys)."""

from __future__ import annotations

from torch import nn


def unwrapped(model: nn.Module) -> nn.Module:
    """`model` without a (Distributed)DataParallel wrapper: the same modules and
    parameters, named without `module.`."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return model.module
    return model
