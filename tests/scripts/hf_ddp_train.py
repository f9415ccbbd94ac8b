"""A Hugging Face Trainer script with nbwatch's callback, for a 2-process torchrun test.

    torchrun --nproc_per_node=2 tests/scripts/hf_ddp_train.py OUT_DIR [MAX_STEPS]

The run folder comes from NBWATCH_RUN_DIR (set by `nbwatch.launch`), else the callback's
default (with MAX_STEPS given, rank 1 makes its callback 1.5 s after rank 0); with
BREAK_RANK1_AT=N, rank 1 raises at step N; with KILL_RANK0_AT=N, rank 0 is killed (SIGKILL) at
step N; with SLOW_RANK1=S, rank 1 sleeps S seconds as each step begins (a slow data
pipeline: a straggler), and the model holds a buffer. Each rank writes the global step
it ended at to OUT_DIR/step_rank{r}.txt.
"""

import os
import signal
import sys
import time

import torch
from transformers import TrainerCallback

import nbwatch.hf
from tests.scripts.group import leave_group
from tests.test_hf import make_trainer


class Break(TrainerCallback):
    """Rank 1's fit fails at a step: a bug of the user's on one rank."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            raise RuntimeError(f"rank 1 broke at step {self.at}")


class Kill(TrainerCallback):
    """Rank 0's process is killed at a step (the OOM killer, a lost node)."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


class Slow(TrainerCallback):
    """Rank 1's host work before each forward takes `s` seconds more: a straggler."""

    def __init__(self, s: float):
        self.s = s

    def on_step_begin(self, args, state, control, **kw):
        time.sleep(self.s)


def main() -> None:
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
    torch.set_num_threads(1)
    trainer = make_trainer(out, max_steps=steps, delay=0.02, eval_steps=100_000,
                           ddp_backend="gloo")
    if len(sys.argv) > 2 and os.environ.get("RANK") == "1":
        time.sleep(1.5)  # its callback named on a later second than rank 0's
    trainer.add_callback(nbwatch.hf.NbwatchCallback(rank_every=5))
    if os.environ.get("BREAK_RANK1_AT") and os.environ.get("RANK") == "1":
        trainer.add_callback(Break(int(os.environ["BREAK_RANK1_AT"])))
    if os.environ.get("KILL_RANK0_AT") and os.environ.get("RANK") == "0":
        trainer.add_callback(Kill(int(os.environ["KILL_RANK0_AT"])))
    if os.environ.get("SLOW_RANK1"):
        # a buffer, as every Llama's rotary inv_freq: DDP broadcasts it from rank 0 as each
        # forward begins, where the fast rank waits for the slow one
        trainer.model.register_buffer("held", torch.zeros(4))
        if os.environ.get("RANK") == "1":
            trainer.add_callback(Slow(float(os.environ["SLOW_RANK1"])))
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"step_rank{rank}.txt"), "w") as f:
        f.write(str(trainer.state.global_step))
    leave_group()


if __name__ == "__main__":
    main()
