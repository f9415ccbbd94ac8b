"""An FSDP2 (`fully_shard`) training script under torchrun (used by tests/test_fsdp.py).

    torchrun --nproc_per_node=2 tests/scripts/fsdp_train.py RUN_DIR MAX_STEPS

Env: LOOP=start (nbwatch's loop, the default) or own (the script's loop with `mon.log()`);
MODEL=tiny (nbwatch.demo.TinyGPT) or gpt2 (a tiny GPT2LMHeadModel, eager attention);
CLIP: nbwatch's clip (max_norm); LOOP_CLIP: the own loop's clip_grad_norm_ before
optimizer.step() (then the reference is taken before that clip); RESUME=1:
`Monitor(..., resume=True)` (own loop); EVAL_EVERY (default 4); STEP_SLEEP (seconds per
step); REF: the reference files' name; KILL_RANK / KILL_AT: that rank kills itself
(SIGKILL) at that step; RAISE_AT: every rank raises there (RAISE_RANK: that rank
alone); CKPT_EVERY: a periodic
checkpoint; REWIND_AT: (start()) rank 0 asks `mon.rewind(steps=3, skip=0)` at that step;
DEFER=1: the GPU's order on the CPU (host_copy.DEFER_ON_CPU); NAN_AT: (own loop) the loss
times NaN at that step on every rank, the nonfinite rule's action the skip only;
OWN_DISK=1: rank 1 names RUN_DIR_node1, as a node with its own disk would;
DISK_FULL_AT: rank 1's shard writes fail with ENOSPC from that step on.

Each rank writes RUN_DIR/{REF}_rank{r}.json: at each optimizer step, torch's own figures
on the sharded model before nbwatch sees the gradients (`clip_grad_norm_(...)
.full_tensor()`, and per layer the norm of the gathered full gradients) and after
nbwatch's clip (`get_total_norm(...).full_tensor()`), and the step it ended at. Rank 0
writes RUN_DIR/{REF}_full_start.pt (the full state dict gathered once the Monitor is made,
after a resume's load) and {REF}_full_end.pt (at the end).
"""

import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

import nbwatch
from nbwatch.demo import TinyGPT, collate
from tests.scripts.group import leave_group


def batches(rank: int, n: int = 16):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of the data
    out = []
    for _ in range(n):
        lengths = torch.randint(6, 24, (4,), generator=g).tolist()
        out.append(collate([torch.randint(1, 60, (L,), generator=g).tolist() for L in lengths]))
    return out


def build(kind: str) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The model and the modules to shard one by one (then the root)."""
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                         attn_implementation="eager")
        model = GPT2LMHeadModel(cfg)
        return model, list(model.transformer.h)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    return model, list(model.blocks)


def logits_of(model, ids):
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def full_state(model) -> dict:
    """The full (unsharded) state dict, on rank 0 (collective)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def main() -> None:
    run_dir, max_steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank and os.environ.get("OWN_DISK"):  # as on a node whose run_dir is on its own disk
        run_dir += "_node1"
    os.makedirs(run_dir, exist_ok=True)
    torch.manual_seed(0)
    model, blocks = build(os.environ.get("MODEL", "tiny"))
    for b in blocks:
        fully_shard(b)
    fully_shard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    owner = {id(p): n.rpartition(".")[0] or "(root)" for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(params, lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.99**s)
    ref_name = os.environ.get("REF", "ref")
    refs: list[dict] = []
    taken: dict = {}

    def measure(max_norm: float) -> None:
        """The full gradients' norms per layer, then torch's clip_grad_norm_ (its norm)."""
        sq: dict[str, float] = {}
        for p in params:
            if p.grad is not None:
                g = p.grad.full_tensor()  # gathered: the full gradient
                sq[owner[id(p)]] = sq.get(owner[id(p)], 0.0) + float(g.double().square().sum())
        total = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        taken["step"] = taken["mon"].step + 1  # nbwatch's count: it follows a rewind
        refs.append({"step": taken["step"], "global": float(total.full_tensor()),
                     "layers": {k: math.sqrt(v) for k, v in sq.items()}})

    loop_clip = float(os.environ["LOOP_CLIP"]) if os.environ.get("LOOP_CLIP") else None

    def before(optimizer, args, kwargs):  # torch's figures, before nbwatch's hook
        if loop_clip is None:
            measure(math.inf)  # scales by 1

    def after(optimizer, args, kwargs):  # after nbwatch's clip
        total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        refs[-1]["after_clip"] = float(total.full_tensor())

    opt.register_step_pre_hook(before)
    clip = float(os.environ["CLIP"]) if os.environ.get("CLIP") else None
    sleep = float(os.environ.get("STEP_SLEEP", "0"))
    eval_every = int(os.environ.get("EVAL_EVERY", "4"))
    data = batches(rank)
    val_batch = batches(99, 1)[0]

    kill_rank, kill_at = int(os.environ.get("KILL_RANK", "-1")), int(os.environ.get("KILL_AT", "0"))
    raise_at = int(os.environ.get("RAISE_AT", "0"))
    calls = {"n": 0}

    def step_fn(model, batch):
        if model.training:  # a training step (not the probe's or val_fn's forward)
            calls["n"] += 1
            if rank == kill_rank and calls["n"] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if calls["n"] == raise_at and int(os.environ.get("RAISE_RANK", rank)) == rank:
                raise RuntimeError(f"the step function failed on purpose at call {raise_at}")
        time.sleep(sleep)
        return {"logits": logits_of(model, batch["input_ids"]), "labels": batch["labels"],
                "mask": batch["mask"]}

    def val_fn(model):  # a forward of the sharded model: every rank calls it
        out = step_fn(model, val_batch)
        return float(nbwatch.masked_cross_entropy(out["logits"], out["labels"], out["mask"]))

    own = os.environ.get("LOOP") == "own"
    if os.environ.get("DEFER"):
        from nbwatch.recorder import host_copy

        host_copy.DEFER_ON_CPU = True
    nan_at = int(os.environ.get("NAN_AT", "0"))
    full_at = int(os.environ.get("DISK_FULL_AT", "0"))
    if full_at and rank == 1:  # this rank's shard writes find the disk full from there on
        import errno

        import torch.distributed.checkpoint.filesystem as dcp_fs

        write = dcp_fs._write_item

        def full(*args, **kwargs):
            if taken["mon"].step >= full_at:
                raise OSError(errno.ENOSPC, "No space left on device")
            return write(*args, **kwargs)

        dcp_fs._write_item = full
    mon = nbwatch.Monitor(model, opt, sched, run_dir=run_dir, clip=clip, rank_every=2,
                          dist_timeout=30, hist_every=3,
                          resume=own and os.environ.get("RESUME") == "1",
                          probe_batch=val_batch if own else None,
                          checkpoint_every=int(os.environ.get("CKPT_EVERY", "0")) or (
                              4 if own else None),
                          config={"script": "fsdp_train"},
                          alerts={"nonfinite": {"actions": ["skip_step"]}} if nan_at else None)
    opt.register_step_pre_hook(after)  # behind nbwatch's hook: after its clip
    taken["mon"] = mon
    start = full_state(model)
    if rank == 0:
        torch.save({"step": mon.step, "state": start},
                   os.path.join(run_dir, f"{ref_name}_full_start.pt"))
    try:
        if own:
            with mon:
                for i in range(mon.step, max_steps):
                    out = step_fn(model, data[i % len(data)])
                    loss = nbwatch.masked_cross_entropy(out["logits"], out["labels"],
                                                        out["mask"])
                    if i + 1 == nan_at:
                        loss = loss * math.nan
                    loss.backward()
                    if loop_clip is not None:  # the loop clips itself, as users do
                        measure(loop_clip)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                    val = val_fn(model) if (i + 1) % eval_every == 0 else None
                    mon.log(loss=loss, mask=out["mask"], val=val)
        else:
            mon.start(step_fn, data, max_steps=max_steps, val_fn=val_fn,
                      eval_every=eval_every, rank_every=2, dist_timeout=30, display=False)
            rewind_at = int(os.environ.get("REWIND_AT", "0"))
            if rewind_at and rank == 0:  # as a click would: rank 0's commands go to all
                while mon.step < rewind_at and mon.running:
                    time.sleep(0.005)
                mon.rewind(steps=3, skip=0)
            mon.wait()
    finally:
        with open(os.path.join(run_dir, f"{ref_name}_rank{rank}.json"), "w") as f:
            json.dump({"end": mon.step, "steps": refs}, f)
        end = full_state(model)
        if rank == 0:
            torch.save({"step": mon.step, "state": end},
                       os.path.join(run_dir, f"{ref_name}_full_end.pt"))
        leave_group()


if __name__ == "__main__":
    main()
    # Every rank did all its work and left the group: end here, so that the interpreter's
    # shutdown cannot meet a gloo worker thread (pytorch#190489: about 1 run in 10 on 2
    # loaded cores aborted a rank with exit -6, with nbwatch and without it alike).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
