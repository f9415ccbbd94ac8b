"""A Lightning DDP script with nbwatch's callback, for a 2-process torchrun test.

    torchrun --nproc_per_node=2 tests/scripts/pl_ddp_train.py OUT_DIR

The run folder comes from NBWATCH_RUN_DIR (set by `nbwatch.launch`). Each rank writes the
global step it ended at to OUT_DIR/step_rank{r}.txt.
"""

import os
import sys

import lightning.pytorch as L
import torch

import nbwatch.lightning
from tests.scripts.group import leave_group
from tests.test_lightning import TinyModule, loader


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=100_000, accelerator="cpu", devices=2, strategy="ddp",
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=out,
                        callbacks=[nbwatch.lightning.NbwatchCallback(rank_every=5)])
    trainer.fit(TinyModule(delay=0.02), train_dataloaders=loader(16))
    with open(os.path.join(out, f"step_rank{trainer.global_rank}.txt"), "w") as f:
        f.write(str(trainer.global_step))
    leave_group()


if __name__ == "__main__":
    main()
