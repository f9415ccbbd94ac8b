"""A Lightning DDP script with nbwatch's callback, for a 2-process torchrun test.

    torchrun --nproc_per_node=2 tests/scripts/pl_ddp_train.py OUT_DIR

The run folder comes from NBWATCH_RUN_DIR (set by `nbwatch.launch`). Each rank writes the
global step it ended at to OUT_DIR/step_rank{r}.txt, and the type of an exception that ended
its fit (what Lightning gave its callbacks' `on_exception`) to OUT_DIR/exception_rank{r}.txt.
KILL_RANK=r with KILL_AT=N kills rank r at step N. MAX_STEPS (100,000) ends the fit there;
CKPT_PATH continues a fit from a Lightning checkpoint (`fit(ckpt_path=...)`).
"""

import os
import sys

import lightning.pytorch as L
import torch

import nbwatch.lightning
from tests.scripts.group import leave_group
from tests.test_lightning import TinyModule, loader


class Die(L.Callback):
    """KILL_RANK=r KILL_AT=N: rank r is killed (SIGKILL) at step N."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (trainer.global_rank == int(os.environ.get("KILL_RANK", "-1"))
                and trainer.global_step == int(os.environ.get("KILL_AT", "0"))):
            os.kill(os.getpid(), 9)


class Seen(L.Callback):
    """Writes down the exception Lightning hands its callbacks (a user's own callback)."""

    def __init__(self, out: str):
        self.out = out

    def on_exception(self, trainer, pl_module, exception):
        with open(os.path.join(self.out, f"exception_rank{trainer.global_rank}.txt"), "w") as f:
            f.write(type(exception).__name__)


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
                                   Die()])
    trainer.fit(TinyModule(delay=0.02), train_dataloaders=loader(16),
                ckpt_path=os.environ.get("CKPT_PATH") or None)
    with open(os.path.join(out, f"step_rank{trainer.global_rank}.txt"), "w") as f:
        f.write(str(trainer.global_step))
    leave_group()


if __name__ == "__main__":
    main()
