"""Command line: `nbwatch demo`, `nbwatch ls [ROOT]`."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .demo import make_demo
    from .monitor import Monitor

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    demo = make_demo(max_steps=args.steps)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / time.strftime(
        "demo-%Y%m%d-%H%M%S")
    mon = Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=run_dir,
                  config=demo.config, name=run_dir.name)
    print(f"nbwatch demo: TinyGPT on Python's own source, {args.steps} steps -> {run_dir}")
    mon.start(max_steps=args.steps, eval_every=args.eval_every, display=False,
              **demo.start_kwargs())
    last = -1
    while mon.running:
        time.sleep(args.print_every)
        df = mon.df
        if df.empty or mon.step == last:
            continue
        last = mon.step
        row = df.iloc[-20:].mean(numeric_only=True)
        val = df["loss/val"].dropna().iloc[-1] if "loss/val" in df else math.nan
        print(f"step {mon.step:5d}/{args.steps}  loss {row['loss/train']:.3f}  "
              f"val {val:.3f}  lr {row['lr']:.2e}  grad {row['grad_norm/global']:.2f}  "
              f"{row.get('throughput/tokens_per_s', math.nan):,.0f} tok/s", flush=True)
    mon.wait()
    df = mon.df
    first = df["loss/train"].iloc[:20].mean()
    final = df["loss/train"].iloc[-20:].mean()
    print(f"done: {mon.state} at step {mon.step}; train loss {first:.3f} -> {final:.3f}")
    samples = mon._run().samples
    if not samples.empty:
        print(f"sample at step {samples.step.iloc[-1]}: {samples.text.iloc[-1]!r}")
    print(f"run folder: {run_dir}  (nbwatch.open_run({str(run_dir)!r}))")
    return 0


def _ls(args: argparse.Namespace) -> int:
    from .run import Run
    from .store import is_run_dir

    root = Path(args.root)
    dirs = sorted(p for p in [root, *root.rglob("*")] if p.is_dir() and is_run_dir(p))
    if not dirs:
        print(f"no nbwatch runs under {root}")
        return 0
    print(f"{'run':40s} {'state':9s} {'step':>7s} {'best val':>9s}")
    for d in dirs:
        run = Run(d)
        df = run.df
        best = df["loss/val"].min() if "loss/val" in df else math.nan
        print(f"{str(d):40s} {run.state:9s} {run.step:7d} {best:9.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nbwatch", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a tiny GPT on Python's own source, monitored")
    d.add_argument("--steps", type=int, default=1000)
    d.add_argument("--eval-every", type=int, default=100)
    d.add_argument("--run-dir", default=None)
    d.add_argument("--print-every", type=float, default=5.0)
    d.set_defaults(fn=_demo)
    ls = sub.add_parser("ls", help="list the runs under a folder")
    ls.add_argument("root", nargs="?", default="runs")
    ls.set_defaults(fn=_ls)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
