"""FSDP2 checkpoints through `torch.distributed.checkpoint` (DCP).

Every rank writes its shards of the model and the optimizer into
`checkpoints/step_XXXXXXXX.dcp/`, then rank 0 writes the nbwatch state (step, scheduler,
RNG, controls, val loss) as `step_XXXXXXXX.pt`, which names that folder: the `.pt` is
written last, so a checkpoint that `resume=True` finds is complete (`sharding.load_sharded`
reads it back). Rotation removes a step's folder with its `.pt` (the best checkpoint's is
kept). The checkpoint folder must be one that every rank can read and write (on several
nodes: a shared filesystem).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from torch import nn

from .checkpoint import Checkpointer, CheckpointWriteError, Saved
from .distributed import lost_peer
from .sharding import is_sharded


class ShardedCheckpointer(Checkpointer):
    """A `Checkpointer` for an FSDP2 model: every rank calls `save` at the same step."""

    every_rank = True

    def __init__(self, directory: str | Path, keep_last: int, model: nn.Module,
                 optimizer: Any):
        super().__init__(directory, keep_last)
        self.model, self.optimizer = model, optimizer
        self.group: Any = None  # nbwatch's own gloo group (its timeout), once a run opens

    def save(self, state: dict[str, Any], step: int, val_loss: float | None = None) -> Saved:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        name = f"step_{step:08d}.dcp"
        partial = self.dir / f"{name}.partial"
        msd, osd = get_state_dict(self.model, self.optimizer)
        try:  # collective: each rank writes its shards, rank 0 the metadata
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(partial),
                     process_group=self.group)
        except Exception as e:
            shutil.rmtree(partial, ignore_errors=True)  # this rank's part of what failed
            first = (str(e).strip().splitlines() or [""])[0][:200]
            newest = self.steps()[-1][0] if self.steps() else None
            since = (f"resume=True continues from step {newest}" if newest is not None
                     else "there is no earlier checkpoint")
            if lost_peer(e):
                raise CheckpointWriteError(
                    f"no checkpoint at step {step}: a sharded (FSDP2) checkpoint needs every "
                    f"rank, and another rank is gone ({first}); {since}") from e
            raise CheckpointWriteError(
                f"sharded checkpoint {self.dir / name} could not be written "
                f"({type(e).__name__}: {first}); {since}") from e
        if dist.get_rank() != 0:
            return Saved(self.dir / name, time.perf_counter() - t0, 0, False)
        final = self.dir / name
        if final.exists():  # a step taken again after a resume
            shutil.rmtree(final)
        os.replace(partial, final)
        saved = super().save({**state, "model": None, "optimizer": None, "sharded": name},
                             step, val_loss)
        self._prune()
        size = saved.bytes + sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
        return Saved(saved.path, time.perf_counter() - t0, size, saved.best)

    def _prune(self) -> None:
        """Remove the shard folders whose `.pt` rotation removed (not the best's)."""
        keep = {p.with_suffix(".dcp").name for _, p in self.steps()}
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            best = int(json.loads((self.dir / "best.json").read_text())["step"])
            keep.add(f"step_{best:08d}.dcp")
        for p in self.dir.glob("step_*.dcp"):
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)


def make_checkpointer(directory: Path, keep_last: int, model: nn.Module, optimizer: Any
                      ) -> Checkpointer:
    """The checkpointer for `model`: DCP shards for an FSDP2 model, else one file."""
    if is_sharded(model):
        return ShardedCheckpointer(directory, keep_last, model, optimizer)
    return Checkpointer(directory, keep_last)
