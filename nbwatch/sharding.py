"""Sharded models: FSDP2 (`fully_shard`) is monitored; FSDP1 and DeepSpeed are refused.

FSDP2's figures are those of the full parameters (probes/sharded.py); its checkpoints are
`torch.distributed.checkpoint` shards (sharded_checkpoint.py), loaded here.
"""

from __future__ import annotations

import contextlib
import errno
from collections import OrderedDict
from pathlib import Path
from typing import Any

from torch import nn


def is_sharded(model: nn.Module) -> bool:
    """Parameters that are DTensors: a model sharded by FSDP2 (`fully_shard`)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def refuse_unsupported(model: Any, optimizer: Any) -> None:
    """FSDP1 and DeepSpeed engines: refused before anything opens, with what works."""
    if any(type(x).__module__.split(".")[0] == "deepspeed" for x in (model, optimizer)):
        raise TypeError(
            f"nbwatch does not monitor DeepSpeed engines ({type(model).__name__}): the engine "
            "runs backward, clipping and the optimizer step itself and partitions the "
            "gradients (ZeRO), so nbwatch can neither measure nor steer them; train with "
            "PyTorch FSDP2 (torch.distributed.fsdp.fully_shard) or DDP and pass the model "
            "and the torch optimizer to nbwatch.Monitor")
    if not isinstance(model, nn.Module):
        return
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without torch.distributed
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(
            "FSDP1 (FullyShardedDataParallel) is not supported: its flat parameters hide the "
            "layers; shard with FSDP2 instead, which nbwatch monitors: "
            "torch.distributed.fsdp.fully_shard(block) for each block, then fully_shard(model)")


@contextlib.contextmanager
def _no_step_hooks(optimizer: Any):
    """The optimizer's own step hooks off: DCP makes an empty optimizer's state with one
    step at LR 0 (`_init_optim_state`), which must not reach nbwatch's hooks as a step."""
    pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    optimizer._optimizer_step_pre_hooks = OrderedDict()
    optimizer._optimizer_step_post_hooks = OrderedDict()
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = pre, post


def load_sharded(folder: Path, model: nn.Module, optimizer: Any, group: Any = None) -> None:
    """Load a DCP checkpoint's model and optimizer shards into `model` and `optimizer`
    (collective: every rank at once, over `group`: nbwatch's own, whose timeout bounds a
    dead rank, once a run is open). A missing folder raises FileNotFoundError."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    seen = [folder.is_dir()]
    if dist.is_available() and dist.is_initialized():  # every rank says, none left waiting
        seen = [False] * dist.get_world_size(group)
        dist.all_gather_object(seen, folder.is_dir(), group=group)
    if not all(seen):
        blind = ", ".join(str(r) for r, ok in enumerate(seen) if not ok)
        raise FileNotFoundError(
            f"the shards of this checkpoint ({folder}) are missing on rank(s) {blind}: every "
            "rank must see the run's checkpoint folder (on several nodes, a shared "
            "filesystem)")
    with _no_step_hooks(optimizer):
        msd, osd = get_state_dict(model, optimizer)
    try:
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(folder),  # in place
                 process_group=group)
    except CheckpointException as e:  # a BaseException: each rank's own error, said
        raise RuntimeError(f"the shards in {folder} could not be read "
                           f"({checkpoint_failure(e)[0]})") from e
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def checkpoint_failure(e: BaseException) -> tuple[str, bool]:
    """The first line of what failed (a `CheckpointException`: each failing rank's own
    error, not torch's traceback) and whether a disk was full."""
    failures = getattr(e, "failures", None)
    causes = ([(f"rank {r}", exc) for r, (exc, _) in sorted(failures.items())]
              if isinstance(failures, dict) and failures else [("", e)])
    said = "; ".join(
        f"{who}{': ' if who else ''}{type(x).__name__}: "
        f"{(str(x).strip().splitlines() or [''])[0][:160]}" for who, x in causes[:3])
    full = any(getattr(x, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or
               "No space left" in str(x) for _, x in causes)
    return said, full
