"""A Lightning DDP script with nbwatch's callback, for a 2-process torchrun test.

    torchrun --nproc_per_node=2 tests/scripts/pl_ddp_train.py OUT_DIR

The run folder comes from NBWATCH_RUN_DIR (set by `nbwatch.launch`). Each rank writes the
global step it ended at to OUT_DIR/step_rank{r}.txt, and the type of an exception that ended
its fit (what Lightning gave its callbacks' `on_exception`) to OUT_DIR/exception_rank{r}.txt.
KILL_RANK=r with KILL_AT=N kills rank r at step N. MAX_STEPS (100,000) ends the fit there;
CKPT_PATH continues a fit from a Lightning checkpoint (`fit(ckpt_path=...)`). With
SLOW_RANK=r, the module holds a buffer (which DDP broadcasts from rank 0 as each training
forward begins) and rank r's dataset takes 0.1 s more for each batch (a slow data pipeline:
a straggler). Each rank writes the forward hooks on the strategy's model (its DDP wrapper)
and on the module, summed, to OUT_DIR/hooks_rank{r}.txt: as the fit began, at step 10, and
once it returned.
"""

import os
import sys
import time

import lightning.pytorch as L
import torch

import nbwatch.lightning
from tests.scripts.group import leave_group
from tests.test_lightning import TinyModule, loader, make_batches


class Die(L.Callback):
    """KILL_RANK=r KILL_AT=N: rank r is killed (SIGKILL) at step N."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (trainer.global_rank == int(os.environ.get("KILL_RANK", "-1"))
                and trainer.global_step == int(os.environ.get("KILL_AT", "0"))):
            os.kill(os.getpid(), 9)


class Slow(torch.utils.data.Dataset):
    """A slow rank's batches, each `s` seconds late (its data loading: a straggler)."""

    def __init__(self, batches: list, s: float):
        self.batches, self.s = batches, s

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int):
        time.sleep(self.s)
        return self.batches[i]


class Seen(L.Callback):
    """Writes down the exception Lightning hands its callbacks (a user's own callback)."""

    def __init__(self, out: str):
        self.out = out

    def on_exception(self, trainer, pl_module, exception):
        with open(os.path.join(self.out, f"exception_rank{trainer.global_rank}.txt"), "w") as f:
            f.write(type(exception).__name__)


class Hooks(L.Callback):
    """Counts the forward hooks on the strategy's model and the module (nbwatch's clock)."""

    def __init__(self):
        self.counts: list[int] = []

    def count(self) -> None:
        self.counts.append(sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
                               for m in {id(m): m for m in self.models}.values()))

    def on_train_start(self, trainer, pl_module):
        self.models = [trainer.strategy.model, pl_module]
        self.count()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 10:
            self.count()


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=int(os.environ.get("MAX_STEPS", "100000")),
                        accelerator="cpu", devices=2, strategy="ddp",
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=out,
                        callbacks=[nbwatch.lightning.NbwatchCallback(rank_every=5), Seen(out),
                                   Die(), hooks := Hooks()])
    module, data = TinyModule(delay=0.02), loader(16)
    if os.environ.get("SLOW_RANK"):
        # a buffer, as a rotary inv_freq or BatchNorm's statistics: DDP broadcasts it from
        # rank 0 as each training forward begins, where a fast rank waits for a slow one
        module.register_buffer("scale", torch.ones(4))
        if os.environ.get("RANK") == os.environ["SLOW_RANK"]:
            data = torch.utils.data.DataLoader(Slow(make_batches(16), 0.1), batch_size=None)
    trainer.fit(module, train_dataloaders=data,
                ckpt_path=os.environ.get("CKPT_PATH") or None)
    with open(os.path.join(out, f"step_rank{trainer.global_rank}.txt"), "w") as f:
        f.write(str(trainer.global_step))
    hooks.count()
    with open(os.path.join(out, f"hooks_rank{trainer.global_rank}.txt"), "w") as f:
        f.write(" ".join(map(str, hooks.counts)))
    leave_group()


if __name__ == "__main__":
    main()
