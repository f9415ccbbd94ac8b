"""Where nbwatch's own time on the training thread goes, part by part, in a live run of
the demo model under `start()` (default probes): each part's time a step, from timers put
around nbwatch's functions for this run only.

    python benchmarks/own_time.py [--steps 200] [--gpu-order]

Prints `time/nbwatch` (the recorder's own clock: median and mean a step, and its share of
the step) and, per part, the mean µs a step, its calls and its median a call. The parts
nest where the code does (the rules run inside the record), so they do not add up.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import nbwatch
from nbwatch import alerts, runner
from nbwatch.demo import make_demo
from nbwatch.probes import late, logits
from nbwatch.recorder import host_copy
from nbwatch.recorder import optimizer_step as ost
from nbwatch.recorder import steering as st
from nbwatch.recorder import step_end as se
from nbwatch.store import writer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402

PARTS = [
    (ost, "param_grad_norms", "pre-hook: gradient norms (_foreach_norm)"),
    (ost, "act_on_host", "pre-hook: one read, the clip and the skip (CPU)"),
    (ost, "act", "pre-hook: the clip and the skip on the device"),
    (se, "read_grads", "record: the step's gradient figures, grads rules"),
    (ost, "layer_norms", "pre-hook: per-layer sums"),
    (ost.wprobe, "snapshot", "pre-hook: weight copy (update-ratio steps)"),
    (ost.wprobe, "update_ratios", "post-hook: update ratios"),
    (se, "complete", "record: rules and the store's queue"),
    (se, "histogram_groups", "end: weight histograms on the device (every 50)"),
    (se, "record_histograms", "read: weight histograms recorded (every 50)"),
    (logits, "logit_parts", "staging: logits' log Z and max |logit| (at the step)"),
    (logits, "row_copy", "staging: the logits' rows copied (for the record)"),
    (runner, "batch_figures", "staging: the mask's figures (at the step)"),
    (runner, "keep_mask", "staging: the mask checked and copied (for the record)"),
    (late, "resolve", "record: the kept masks' and rows' figures"),
    (st, "poll_commands", "boundary: command poll"),
    (alerts.AlertEngine, "observe", "the rules (all phases)"),
    (writer.RunStore, "put", "the store's queue (put)"),
]


def timed(times: dict[str, list[float]], owner, name: str, label: str) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter() - t0)

    setattr(owner, name, run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--gpu-order", action="store_true",
                    help="the GPU's path on the CPU: decided on tensors, read a step later")
    args = ap.parse_args()
    n = args.steps
    host_copy.DEFER_ON_CPU = args.gpu_order
    times: dict[str, list[float]] = collections.defaultdict(list)
    for owner, name, label in PARTS:
        timed(times, owner, name, label)
    demo = make_demo(max_steps=10**9)
    demo.scheduler = torch.optim.lr_scheduler.LambdaLR(demo.optimizer, lambda s: 1.0)
    with tempfile.TemporaryDirectory() as tmp:
        r = overhead.monitored(demo, n, 5, Path(tmp))
        df = nbwatch.open_run(next(Path(tmp).iterdir())).df
    own = df["time/nbwatch"].iloc[5:]
    print(f"{n} steps of {r.step * 1e3:.1f} ms: time/nbwatch median {own.median() * 1e6:.0f} µs,"
          f" mean {own.mean() * 1e6:.0f} µs ({r.own:.2%} of the step)")
    for label, v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {label:44s}  {sum(v) / n * 1e6:6.0f} µs a step ({len(v)} calls, median "
              f"{statistics.median(v) * 1e6:.0f} µs)")


if __name__ == "__main__":
    main()
