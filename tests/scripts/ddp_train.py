"""A training script that runs unchanged alone or under torchrun (used by the tests).

    python tests/scripts/ddp_train.py RUN_DIR [MAX_STEPS]
    torchrun --nproc_per_node=2 tests/scripts/ddp_train.py RUN_DIR [MAX_STEPS]

Env: STEP_SLEEP (seconds per step, default 0.01); KILL_RANK / KILL_AT (a rank that kills
itself with SIGKILL at that step); STOP_AT (rank 0 calls `mon.stop()` in that step);
SIGTERM_AT (rank 0 sends itself SIGTERM in that step, as torchrun forwards one);
CKPT_EVERY (a periodic checkpoint); RUN_DIR=default: `Monitor(run_dir=None)`, and rank 1
comes to it 1.5 s after rank 0; ONLY_RANK0=1: rank 1 creates no Monitor; RAISE_RANK /
RAISE_AT: a rank whose step_fn raises ValueError at that call; NO_DDP=1: the model not
wrapped; R0_STEPS: rank 0's own loop takes this many steps (uneven data); LOOP=own: the
script's own loop with `mon.log()` in the foreground instead of `mon.start()` (RESUME=1:
`resume=True`; RANK_EVERY: its rank_every, 5; AFTER_SLEEP: seconds rank 1 sleeps after
each optimizer step, before `log()`); AUDIT=1 (with
LOOP=own): the GPU's order on the CPU, a histogram every 5 steps, torch's reading methods
watched in steps 6–25,
what nbwatch read written to RUN_DIR/audit_rank{r}.json (tests/recorder/test_host_copy.py).
At the end each rank writes a checksum of its parameters to RUN_DIR/params_rank{r}.pt.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import nbwatch
from nbwatch.demo import TinyGPT, collate


def batches(rank: int, n: int = 32):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    out = []
    for _ in range(n):
        lengths = torch.randint(6, 30, (4,), generator=g).tolist()
        out.append(collate([torch.randint(1, 60, (L,), generator=g).tolist() for L in lengths]))
    return out


def main() -> None:
    run_dir, max_steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    # a buffer, as every Hugging Face Llama's rotary `inv_freq`: DDP broadcasts it from
    # rank 0 as each forward begins, where rank 0 waits for a slow rank 1
    model.register_buffer("inv_freq", torch.ones(4), persistent=False)
    if dist.is_initialized() and not os.environ.get("NO_DDP"):
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.999**s)
    sleep = float(os.environ.get("STEP_SLEEP", "0.01"))
    kill_rank, kill_at = int(os.environ.get("KILL_RANK", "-1")), int(os.environ.get("KILL_AT", "0"))
    calls = {"n": 0}
    stop_at = int(os.environ.get("STOP_AT", "0"))
    sigterm_at = int(os.environ.get("SIGTERM_AT", "0"))
    raise_rank = int(os.environ.get("RAISE_RANK", "-1"))
    raise_at = int(os.environ.get("RAISE_AT", "0"))
    after = float(os.environ.get("AFTER_SLEEP", "0"))

    def step_fn(model, batch):
        calls["n"] += 1
        if rank == kill_rank and calls["n"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == raise_rank and calls["n"] == raise_at:
            raise ValueError(f"rank {rank} failed on purpose at call {raise_at}")
        if rank == 0 and calls["n"] == stop_at:
            mon.stop()  # taken at the ranks' next meeting
        if rank == 0 and calls["n"] == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(sleep * (2 if rank == 1 else 1))  # rank 1 is a straggler
        return {"logits": model(batch["input_ids"]), "labels": batch["labels"],
                "mask": batch["mask"]}

    mon = None
    try:
        if os.environ.get("LOOP") == "own":
            mon = nbwatch.Monitor(model, opt, sched, run_dir=run_dir,
                                  rank_every=int(os.environ.get("RANK_EVERY", "5")),
                                  dist_timeout=20, config={"script": "ddp_train", "loop": "own"},
                                  resume=bool(os.environ.get("RESUME")),
                                  hist_every=5 if os.environ.get("AUDIT") else 50)
            data = batches(rank)
            if rank == 0 and os.environ.get("R0_STEPS"):
                max_steps = int(os.environ["R0_STEPS"])
            audit = None
            if os.environ.get("AUDIT"):
                from tests.recorder.test_host_copy import STEADY, Audit

                audit = Audit().install(setattr)
            with mon:
                for i in range(mon.step, max_steps):
                    if audit is not None:
                        audit.on = i + 1 in STEADY
                    out = step_fn(model, data[i % len(data)])
                    loss = nbwatch.masked_cross_entropy(out["logits"], out["labels"],
                                                        out["mask"])
                    loss.backward()
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                    if rank == 1:  # host work after the step (a log line, a metric)
                        time.sleep(after)
                    mon.log(loss=loss, mask=out["mask"])
            if audit is not None:
                audit.on = False
                audit.save(os.path.join(run_dir, f"audit_rank{rank}.json"))
        else:
            if os.environ.get("RUN_DIR") == "default" and rank == 1:
                time.sleep(1.5)  # each rank's clock names a default folder by the second
            if os.environ.get("ONLY_RANK0") and rank == 1:
                time.sleep(15)  # a script that watches on rank 0 alone
                return
            mon = nbwatch.Monitor(model, opt, sched, config={"script": "ddp_train"},
                                  run_dir=None if os.environ.get("RUN_DIR") else run_dir)
            run_dir = str(mon.run_dir)
            every = int(os.environ.get("CKPT_EVERY", "0")) or None
            mon.start(step_fn, batches(rank), max_steps=max_steps, rank_every=5,
                      dist_timeout=float(os.environ.get("DIST_TIMEOUT", "20")),
                      display=False, checkpoint_every=every)
            mon.wait()
    finally:
        if mon is not None:
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            path = os.path.join(run_dir, f"params_rank{rank}.pt")
            torch.save({"step": mon.step, "params": flat}, path)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
