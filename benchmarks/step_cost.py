"""nbwatch's fixed cost per optimizer step, on a model so small that the step is almost
nothing but that cost (what a user with fast GPU steps pays).

Variants run interleaved in one process, several rounds each:

  bare        the user's loop, main thread, nothing recorded
  log         the same loop with `mon.log(loss=loss)`, in the foreground (`with mon:`)
  run         the same loop with `mon.log`, in nbwatch's thread (`mon.run(train)`)
  start       `mon.start(step_fn, ...)`: nbwatch's own loop

    python benchmarks/step_cost.py [--steps 3000] [--rounds 5] [--profile] [--tensors 148]
                                   [--gpu-order] [--clip 1.0] [--acting] [--packed 16x1024]

`--gpu-order` runs a GPU's step path on the CPU (every decision on tensors, the figures
copied at the step's end and read at a later boundary): on a CPU each of its small ops
costs about what a kernel launch costs a GPU's host, so its own time is the host work a
GPU's step pays. `--clip` turns the clip on (its coefficient is computed on the device).
`--packed BxT` hands each step a packed batch of B rows of T tokens (`position_ids`, no
mask, documents of 1-2T/8 tokens; `log(batch=...)`, and start()'s batch): the cost of its
documents' figures and `data/seq_len` lengths, which grow with the batch.
`--acting` adds the variant `log acting`: `log` with a "step" rule given an action
(`plateau` pauses), whose run records each step at its read rather than in batches.

Prints, per variant, the steady µs a step and what it adds over bare (and how much of
that is nbwatch's own time on the training thread, `time/nbwatch`: the rest is torch's
own work slowed by the code run between its steps), the whole run
(opening to close) per step, its start-up and close apart, and (with --profile) where
the `log` variant's time goes (cProfile, the 25 largest by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

import nbwatch
from nbwatch.recorder import host_copy

KW: dict = {}  # the Monitor's options of this run (--clip)
LAYERS = [0]  # --tensors: 0, the 16-32-1 MLP; else this many 8 x 8 Linear layers
PACKED: list[dict | None] = [None]  # --packed: the batch each step hands over


def packed_batch(rows: int, length: int, seed: int = 0) -> dict:
    """`rows` rows of `length` tokens, each packed with documents of 1 to length/4 tokens
    (their `position_ids` restart at 0 at each document's first token)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.empty(rows, length, dtype=torch.long)
    for r in range(rows):
        at = 0
        while at < length:
            n = min(int(torch.randint(1, max(2, length // 4), (1,), generator=g)), length - at)
            pos[r, at:at + n] = torch.arange(n)
            at += n
    return {"input_ids": torch.zeros(rows, length, dtype=torch.long), "position_ids": pos}


def make(seed: int = 0):
    torch.manual_seed(seed)
    if LAYERS[0]:  # as many parameter tensors as a real model, each nearly free to compute
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(LAYERS[0])])
        x, y = torch.randn(8, 8), torch.randn(8, 8)
    else:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        x, y = torch.randn(8, 16), torch.randn(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return model, opt, x, y


def loop(model, opt, x, y, n: int, mon=None) -> None:
    for _ in range(n):
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mon is not None:
            mon.log(loss=loss, batch=PACKED[0])


def bare(n: int, root: Path) -> float:
    model, opt, x, y = make()
    loop(model, opt, x, y, 50)  # warm
    t0 = time.perf_counter()
    loop(model, opt, x, y, n)
    return (time.perf_counter() - t0) / n


class Timing(NamedTuple):
    """One monitored run: steady µs a step (wall clock between recorded steps, after a
    warm-up), and the whole run from the call that opens it to the one that ends it,
    with its start-up (to the first recorded step) and close (from the last) apart."""

    steady: float  # s a step, between step `warm` and `warm + n`
    whole: float  # s a step, opening and closing included
    startup: float  # s from the call to the first step's record
    close: float  # s from the last step's record to the end of wait()/with
    own: float = 0.0  # s a step of nbwatch's own time (`time/nbwatch`), mean over the n


def _timing(run_dir: Path, warm: int, n: int, t0: float, t1: float) -> Timing:
    """`t0`, `t1`: wall time (time.time) before the run opened and after it closed."""
    run = nbwatch.open_run(run_dir)
    walls = run.reader.walls()
    steady = (walls.loc[warm + n] - walls.loc[warm]) / n
    own = float(run.df["time/nbwatch"].loc[warm + 1:warm + n].mean())
    return Timing(steady, (t1 - t0) / (warm + n), walls.iloc[0] - t0, t1 - walls.iloc[-1], own)


def log_foreground(n: int, root: Path, warm: int = 50, **kw) -> Timing:
    model, opt, x, y = make()
    run_dir = root / f"log{time.monotonic_ns()}"
    t0 = time.time()
    with nbwatch.Monitor(model, opt, run_dir=run_dir, display=False, **KW, **kw) as mon:
        loop(model, opt, x, y, warm + n, mon)
    return _timing(run_dir, warm, n, t0, time.time())


def log_acting(n: int, root: Path) -> Timing:
    return log_foreground(n, root, alerts={"plateau": {"actions": ["pause"]}})


def log_thread(n: int, root: Path, warm: int = 50) -> Timing:
    model, opt, x, y = make()
    run_dir = root / f"run{time.monotonic_ns()}"
    t0 = time.time()
    mon = nbwatch.Monitor(model, opt, run_dir=run_dir, display=False, **KW)
    mon.run(loop, model, opt, x, y, warm + n, mon).wait()
    return _timing(run_dir, warm, n, t0, time.time())


def start(n: int, root: Path, warm: int = 50) -> Timing:
    model, opt, x, y = make()
    run_dir = root / f"start{time.monotonic_ns()}"
    t0 = time.time()
    mon = nbwatch.Monitor(model, opt, run_dir=run_dir, **KW)
    batch = {"x": x, "y": y, **(PACKED[0] or {})}
    mon.start(lambda m, b: (m(b["x"]) - b["y"]).square().mean(), itertools.repeat(batch),
              max_steps=warm + n, display=False).wait()
    return _timing(run_dir, warm, n, t0, time.time())


def bare_timing(n: int, root: Path) -> Timing:
    per = bare(n, root)
    return Timing(per, per, 0.0, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--gpu-order", action="store_true")
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--acting", action="store_true")
    ap.add_argument("--tensors", type=int, default=0,
                    help="a model of this many parameter tensors (8 x 8 Linear layers, "
                         "GPT-2 124M has 148): what nbwatch does per tensor")
    ap.add_argument("--packed", default=None, metavar="BxT",
                    help="hand each step a packed batch of B rows of T tokens")
    args = ap.parse_args()
    if args.packed:
        rows, length = (int(v) for v in args.packed.lower().split("x"))
        PACKED[0] = packed_batch(rows, length)
    LAYERS[0] = (args.tensors + 1) // 2
    host_copy.DEFER_ON_CPU = args.gpu_order
    if args.clip is not None:
        KW["clip"] = args.clip
    torch.set_num_threads(1)
    variants = {"bare": bare_timing, "log": log_foreground, "run": log_thread, "start": start}
    if args.acting:
        variants["log acting"] = log_acting
    results: dict[str, list[Timing]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for r in range(args.rounds):
            for name, fn in variants.items():
                results.setdefault(name, []).append(fn(args.steps, root))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} {v[-1].steady * 1e6:.0f} µs" for k, v in results.items()), flush=True)
        base = statistics.median(t.steady for t in results["bare"])
        print(f"\n{args.steps} steps (+50 warm-up) x {args.rounds} rounds, median over rounds "
              + (f"({LAYERS[0]} 8 x 8 Linear layers" if LAYERS[0] else "(a 16-32-1 MLP")
              + ", SGD, 1 thread"
              + (", the GPU's order" if args.gpu_order else "")
              + (f", clip {args.clip}" if args.clip is not None else "")
              + (f", packed batches {args.packed}" if args.packed else "") + ")")
        print("| variant | steady µs/step | added over bare | of it nbwatch's own time "
              "(time/nbwatch) | ratio | whole run µs/step (added) | start-up s | close s |")
        print("|---|---|---|---|---|---|---|---|")
        for name, ts in results.items():
            med = statistics.median(t.steady for t in ts)
            whole = statistics.median(t.whole for t in ts)
            up = statistics.median(t.startup for t in ts)
            close = statistics.median(t.close for t in ts)
            own = statistics.median(t.own for t in ts)
            print(f"| {name} | {med * 1e6:.0f} | {(med - base) * 1e6:+.0f} µs | "
                  f"{own * 1e6:.0f} µs | {med / base:.2f}x | {whole * 1e6:.0f} "
                  f"({(whole - base) * 1e6:+.0f}) | {up:.2f} | {close:.2f} |")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            log_foreground(args.steps, root)
            prof.disable()
            print(f"\nwhere `log` spends its time ({args.steps} steps):")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
