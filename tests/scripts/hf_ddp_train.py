"""A Hugging Face Trainer script with nbwatch's callback, for a 2-process torchrun test.

    torchrun --nproc_per_node=2 tests/scripts/hf_ddp_train.py OUT_DIR

The run folder comes from NBWATCH_RUN_DIR (set by `nbwatch.launch`). Each rank writes the
global step it ended at to OUT_DIR/step_rank{r}.txt.
"""

import os
import sys

import torch

import nbwatch.hf
from tests.scripts.group import leave_group
from tests.test_hf import make_trainer


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    trainer = make_trainer(out, max_steps=100_000, delay=0.02, eval_steps=100_000,
                           ddp_backend="gloo")
    trainer.add_callback(nbwatch.hf.NbwatchCallback(rank_every=5))
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"step_rank{rank}.txt"), "w") as f:
        f.write(str(trainer.state.global_step))
    leave_group()


if __name__ == "__main__":
    main()
