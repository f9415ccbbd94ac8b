"""nbwatch's fixed cost per optimizer step, on a model so small that the step is almost
nothing but that cost (what a user with fast GPU steps pays).

Variants run interleaved in one process, several rounds each:

  bare        the user's loop, main thread, nothing recorded
  log         the same loop with `mon.log(loss=loss)`, in the foreground (`with mon:`)
  run         the same loop with `mon.log`, in nbwatch's thread (`mon.run(train)`)
  start       `mon.start(step_fn, ...)`: nbwatch's own loop

    python benchmarks/step_cost.py [--steps 3000] [--rounds 5] [--profile]

Prints µs per step, the cost added over bare, and (with --profile) where the `log`
variant's time goes (cProfile, the 25 largest by own time).
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

import torch
from torch import nn

import nbwatch


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    return model, opt, x, y


def loop(model, opt, x, y, n: int, mon=None) -> None:
    for _ in range(n):
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mon is not None:
            mon.log(loss=loss)


def bare(n: int, root: Path) -> float:
    model, opt, x, y = make()
    loop(model, opt, x, y, 50)  # warm
    t0 = time.perf_counter()
    loop(model, opt, x, y, n)
    return (time.perf_counter() - t0) / n


def _per_step(run_dir: Path, warm: int, n: int) -> float:
    walls = nbwatch.open_run(run_dir).reader.walls()
    return (walls.loc[warm + n] - walls.loc[warm]) / n


def log_foreground(n: int, root: Path, warm: int = 50) -> float:
    model, opt, x, y = make()
    run_dir = root / f"log{time.monotonic_ns()}"
    with nbwatch.Monitor(model, opt, run_dir=run_dir, display=False) as mon:
        loop(model, opt, x, y, warm + n, mon)
    return _per_step(run_dir, warm, n)


def log_thread(n: int, root: Path, warm: int = 50) -> float:
    model, opt, x, y = make()
    run_dir = root / f"run{time.monotonic_ns()}"
    mon = nbwatch.Monitor(model, opt, run_dir=run_dir, display=False)
    mon.run(loop, model, opt, x, y, warm + n, mon).wait()
    return _per_step(run_dir, warm, n)


def start(n: int, root: Path, warm: int = 50) -> float:
    model, opt, x, y = make()
    run_dir = root / f"start{time.monotonic_ns()}"
    mon = nbwatch.Monitor(model, opt, run_dir=run_dir)
    mon.start(lambda m, b: (m(b[0]) - b[1]).square().mean(), itertools.repeat((x, y)),
              max_steps=warm + n, display=False).wait()
    return _per_step(run_dir, warm, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    variants = {"bare": bare, "log": log_foreground, "run": log_thread, "start": start}
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for r in range(args.rounds):
            for name, fn in variants.items():
                results.setdefault(name, []).append(fn(args.steps, root))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} {v[-1] * 1e6:.0f} µs" for k, v in results.items()), flush=True)
        base = statistics.median(results["bare"])
        print(f"\n{args.steps} steps x {args.rounds} rounds, median over rounds "
              "(a 16-32-1 MLP, SGD, 1 thread)")
        print("| variant | µs/step | added over bare | ratio |")
        print("|---|---|---|---|")
        for name, times in results.items():
            med = statistics.median(times)
            print(f"| {name} | {med * 1e6:.0f} | {(med - base) * 1e6:+.0f} µs | "
                  f"{med / base:.2f}x |")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            log_foreground(args.steps, root)
            prof.disable()
            print(f"\nwhere `log` spends its time ({args.steps} steps):")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
