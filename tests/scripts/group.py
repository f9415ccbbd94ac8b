"""The end of a torchrun test script."""

from __future__ import annotations

import contextlib

import torch.distributed as dist


def leave_group() -> None:
    """Every rank done, then the group torn down, as a torchrun script should end: without
    it torch's gloo worker can free a collective's tensors during interpreter shutdown and
    abort the rank ("terminate called without an active exception": pytorch#190489, bare
    scripts too)."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()
