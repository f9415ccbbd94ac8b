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
import uuid
from pathlib import Path
from typing import Any

from torch import nn

from .checkpoint import Checkpointer, CheckpointWriteError, Saved
from .distributed import Dist, lost_peer
from .sharding import checkpoint_failure, is_sharded


class ShardedCheckpointer(Checkpointer):
    """A `Checkpointer` for an FSDP2 model: every rank calls `save` at the same step."""

    every_rank = True

    def __init__(self, directory: str | Path, keep_last: int, model: nn.Module,
                 optimizer: Any):
        super().__init__(directory, keep_last)
        self.model, self.optimizer = model, optimizer
        self.group: Any = None  # nbwatch's own gloo group (its timeout), once a run opens

    def open_run(self, dist: Dist) -> None:
        """As a run opens, on every rank: save through nbwatch's own group (its timeout),
        into a folder every rank sees (`check_shared`); on a refusal, the group is closed."""
        self.group = dist.group
        try:
            self.check_shared(dist.rank, dist.group)
        except BaseException:
            dist.close()
            raise

    def check_shared(self, rank: int, group: Any) -> None:
        """Refuse, on every rank at once, a checkpoint folder that some rank sees elsewhere
        (several nodes, each on its own disk): every rank writes its shards there, so rank
        0's checkpoints would lack theirs and never resume. A collective: each rank calls
        it as its run opens."""
        import torch.distributed as dist

        name = [f".shared-check-{uuid.uuid4().hex[:12]}"]
        if rank == 0:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                (self.dir / name[0]).write_bytes(b"")
            except OSError as e:  # said on every rank, none waiting for a file never made
                name = [f"!{e}"]
        dist.broadcast_object_list(name, src=0, group=group)
        if name[0].startswith("!"):
            raise RuntimeError(f"the checkpoint folder {self.dir} cannot be written on rank 0 "
                               f"({name[0][1:]}); pass a run_dir every rank can write")
        seen: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, _sees(self.dir, name[0]), group=group)
        if rank == 0:
            (self.dir / name[0]).unlink(missing_ok=True)
        blind = [r for r, ok in enumerate(seen) if not ok]
        if blind:
            ranks = ", ".join(map(str, blind))
            raise RuntimeError(
                f"FSDP2 checkpoints are written by every rank into {self.dir}, but rank(s) "
                f"{ranks} do not see what rank 0 writes there (nodes each with their own "
                "disk?): a checkpoint would hold rank 0's shards only and never resume. Put "
                "run_dir on a filesystem every node shares (NFS, Lustre, GPFS), the same "
                "path on every node")

    def save(self, state: dict[str, Any], step: int, val_loss: float | None = None) -> Saved:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        name = f"step_{step:08d}.dcp"
        partial = self.dir / f"{name}.partial"
        msd, osd = get_state_dict(self.model, self.optimizer)
        try:  # collective: each rank writes its shards, rank 0 the metadata
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(partial),
                     process_group=self.group)
        except (Exception, CheckpointException) as e:  # torch's is a BaseException
            shutil.rmtree(partial, ignore_errors=True)  # this rank's part of what failed
            first, full = checkpoint_failure(e)
            newest = self.steps()[-1][0] if self.steps() else None
            since = (f"resume=True continues from step {newest}" if newest is not None
                     else "there is no earlier checkpoint")
            if lost_peer(e):
                raise CheckpointWriteError(
                    f"no checkpoint at step {step}: a sharded (FSDP2) checkpoint needs every "
                    f"rank, and another rank is gone ({first}); {since}") from e
            raise CheckpointWriteError(
                ("disk full: " if full else "")
                + f"sharded checkpoint {self.dir / name} could not be written ({first}); its "
                f"partial folder was removed; {since}"
                + (" once space is freed there" if full else "")) from e
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
        """Remove the shard folders whose `.pt` rotation removed (not the best's), and
        any a save never finished (every rank's save of this step is done)."""
        keep = {p.with_suffix(".dcp").name for _, p in self.steps()}
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            best = int(json.loads((self.dir / "best.json").read_text())["step"])
            keep.add(f"step_{best:08d}.dcp")
        for p in self.dir.glob("step_*.dcp"):
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.dir.glob("step_*.dcp.partial"):  # a save a kill cut short
            shutil.rmtree(p, ignore_errors=True)


def _sees(folder: Path, name: str, wait: float = 5.0) -> bool:
    """Whether `folder` holds `name`, waiting up to `wait` s: a network filesystem's
    caches may show another node's new file late. The folder is listed, not stat-ed: a
    listing is fetched again where a cached "no such file" is not."""
    deadline = time.monotonic() + wait
    while True:
        try:
            if name in os.listdir(folder):
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def make_checkpointer(directory: Path, keep_last: int, model: nn.Module, optimizer: Any
                      ) -> Checkpointer:
    """The checkpointer for `model`: DCP shards for an FSDP2 model, else one file."""
    if is_sharded(model):
        return ShardedCheckpointer(directory, keep_last, model, optimizer)
    return Checkpointer(directory, keep_last)
