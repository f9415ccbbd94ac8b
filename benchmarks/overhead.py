"""Training-loop overhead of nbwatch's probes, as ratios of a bare loop's step time.

Same model (the demo's 4-layer d=128 GPT), same data, same optimizer; the variants run
interleaved in one process, several rounds each, so that machine noise hits all alike:

  bare         the loop a user writes, nothing recorded, run as `start()` runs a loop: in
               a thread of its own, the caller's OpenMP pool released (the baseline)
  bare (main thread)  the same loop in the main thread, as a user runs it without nbwatch
  default      nbwatch.Monitor with default probes (histograms/update ratios every 50 steps)
  own loop     the bare loop with `mon.log(loss=..., mask=...)`, run by `mon.run(train)`
               (the user's own loop, default probes)
  ratios/step  default probes with the update ratios every step (`update_every=1`)
  all/step     every per-step probe every step: weight histograms and update ratios each
               step (attention stays an eval-time probe by design: a separate forward pass)
  +attention   all/step plus the attention probe pass every step (an upper bound)
  tensorboard  the seeds' recipe in the main thread: per-parameter `.item()` grad norms and
               add_scalar every step, add_histogram of every weight and grad every 50 steps

    python benchmarks/overhead.py [--steps 60] [--rounds 9] [--only default,ratios/step]

Why the baseline runs in a thread: in one process, the bare loop in the main thread ran
~4% slower than the same loop in a thread after `start()`-style pool release (12 rounds
on 2 cores, 2026-12-02), so a main-thread baseline hid nbwatch's cost (ratios of 0.99×).
Each round runs the variants in turn, the order reversed every other round.

A second table measures the cost where it is spent, which the ratio of two step times
cannot resolve on a noisy machine (a 1% cost under rounds that differ by 10%): each
monitored step records `time/nbwatch`, nbwatch's own time on the training thread, so
`step / (step - own)` is the ratio to the same step unwatched; beside it the process's CPU
time a step (every thread: nbwatch's store writer and system sampler, torch's intra-op
threads) over the bare loop's, taken from step `warm` to the last.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

import nbwatch
from nbwatch._omp import release_caller_pool
from nbwatch.demo import make_demo, masked_cross_entropy


def cpu_s() -> float:
    """CPU time of the whole process so far (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Round:
    """One round of a variant: mean step time (s), nbwatch's own share of it (from
    `time/nbwatch`; 0 for a loop without nbwatch), CPU seconds a step (every thread)."""

    def __init__(self, step: float, own: float, cpu: float):
        self.step, self.own, self.cpu = step, own, cpu


class CpuMarks:
    """The process's CPU time at the `warm`-th call and at the last."""

    def __init__(self, warm: int, last: int):
        self.warm, self.last, self.calls, self.t = warm, last, 0, [0.0, 0.0]

    def tick(self) -> None:
        self.calls += 1
        if self.calls == self.warm:
            self.t[0] = cpu_s()
        elif self.calls == self.last:
            self.t[1] = cpu_s()

    def per_step(self, n: int) -> float:
        return (self.t[1] - self.t[0]) / n


def measured(run_dir: Path, warm: int, n: int, cpu: CpuMarks) -> Round:
    """A monitored round's figures from its run folder."""
    run = nbwatch.open_run(run_dir)
    walls = run.reader.walls()
    wall = walls.loc[warm + n] - walls.loc[warm]
    own = float(run.df["time/nbwatch"].loc[warm + 1:warm + n].sum())
    return Round(wall / n, own / wall, cpu.per_step(n))


def loss_of(model, batch):
    return masked_cross_entropy(model(batch["input_ids"]), batch["labels"], batch["mask"])


def batches_forever(data):
    while True:
        yield from data


def bare(demo, n, warm, tb=None):
    model, opt, sched = demo.model, demo.optimizer, demo.scheduler
    it = batches_forever(demo.train)
    times = []
    cpu = CpuMarks(warm + 1, warm + n + 1)
    for step in range(warm + n + 1):
        cpu.tick()
        if step == warm + n:
            break
        t0 = time.perf_counter()
        batch = next(it)
        loss = loss_of(model, batch)
        loss.backward()
        if tb is not None:
            total = 0.0
            for name, p in model.named_parameters():
                g = p.grad.norm().item()  # one sync per parameter: the seeds' recipe
                tb.add_scalar(f"grad_norm/{name}", g, step)
                total += g * g
            tb.add_scalar("grad_norm/global", total**0.5, step)
            tb.add_scalar("loss/train", loss.item(), step)
            tb.add_scalar("lr", opt.param_groups[0]["lr"], step)
            if step % 50 == 0:
                for name, p in model.named_parameters():
                    tb.add_histogram(f"weight/{name}", p, step)
                    tb.add_histogram(f"grad/{name}", p.grad, step)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step >= warm:
            times.append(time.perf_counter() - t0)
    return Round(sum(times) / n, 0.0, cpu.per_step(n))


def in_thread(fn):
    """`fn()` run as `start()` runs a loop: the caller's OpenMP pool released, then in a
    thread of its own."""
    release_caller_pool()
    box = []
    t = threading.Thread(target=lambda: box.append(fn()), name="bare")
    t.start()
    t.join()
    return box[0]


def monitored(demo, n, warm, root: Path, **start_kw):
    run_dir = root / f"run{time.monotonic_ns()}"
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=run_dir)
    cpu = CpuMarks(warm + 1, warm + n + 1)  # step_fn's calls: after `warm` steps, at the end

    def step_fn(m, b):
        cpu.tick()
        return {"logits": m(b["input_ids"]), "labels": b["labels"], "mask": b["mask"]}

    mon.start(step_fn, batches_forever(demo.train), max_steps=warm + n + 1, display=False,
              **start_kw)
    mon.wait()
    return measured(run_dir, warm, n, cpu)


def own_loop(demo, n, warm, root: Path):
    run_dir = root / f"own{time.monotonic_ns()}"
    model, opt, sched = demo.model, demo.optimizer, demo.scheduler
    mon = nbwatch.Monitor(model, opt, sched, run_dir=run_dir, display=False)

    cpu = CpuMarks(warm + 1, warm + n + 1)

    def train():
        it = batches_forever(demo.train)
        for _ in range(warm + n + 1):
            cpu.tick()
            batch = next(it)
            loss = loss_of(model, batch)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            mon.log(loss=loss, mask=batch["mask"])

    mon.run(train).wait()
    return measured(run_dir, warm, n, cpu)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--only", default="",
                    help="comma-separated variants (the two bare loops always run)")
    args = ap.parse_args()
    demo = make_demo(max_steps=10**9)
    demo.scheduler = torch.optim.lr_scheduler.LambdaLR(demo.optimizer, lambda s: 1.0)
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        SummaryWriter = None
        print("tensorboard not installed: skipping its row (pip install tensorboard)")
    n, warm = args.steps, args.warm
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        variants = {
            "bare": lambda: in_thread(lambda: bare(demo, n, warm)),
            "bare (main thread)": lambda: bare(demo, n, warm),
            "default": lambda: monitored(demo, n, warm, root),
            "own loop": lambda: own_loop(demo, n, warm, root),
            "ratios/step": lambda: monitored(demo, n, warm, root, update_every=1),
            "all/step": lambda: monitored(demo, n, warm, root, hist_every=1),
            "+attention": lambda: monitored(
                demo, n, warm, root, hist_every=1, eval_every=1, checkpoint_every=10**9,
                probe_batch=demo.probe_batch, probe_tokens=demo.probe_tokens),
        }
        if SummaryWriter is not None and (not args.only or "tensorboard" in args.only):
            def tensorboard():
                with SummaryWriter(str(root / f"tb{time.monotonic_ns()}")) as tb:
                    return in_thread(lambda: bare(demo, n, warm, tb))
            variants["tensorboard"] = tensorboard
        if args.only:
            keep = {"bare", "bare (main thread)", *args.only.split(",")}
            variants = {k: v for k, v in variants.items() if k in keep}
        for r in range(args.rounds):
            order = list(variants.items())
            for name, fn in order[::-1] if r % 2 else order:
                results.setdefault(name, []).append(fn())
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} {v[-1].step * 1e3:.1f} ms" + (f" (own {v[-1].own:.2%})" if v[-1].own else "")
                for k in variants for v in [results[k]]), flush=True)
    steps = {k: [r.step for r in v] for k, v in results.items()}
    best = min(steps["bare"])
    print(f"\n{torch.get_num_threads()} threads, {n} steps x {args.rounds} rounds; a round's mean "
          "step time as a ratio to the same round's bare: the median over rounds and their "
          "spread (min–max); the fastest rounds' ratio beside it")
    print("| variant | ms/step (median) | ratio (median) | spread | ratio (fastest) |")
    print("|---|---|---|---|---|")
    for name, times in steps.items():
        med = statistics.median(times)
        per = [t / b for t, b in zip(times, steps["bare"])]
        print(f"| {name} | {med * 1e3:.1f} | {statistics.median(per):.3f}x | "
              f"{min(per):.3f}–{max(per):.3f} | {min(times) / best:.3f}x |")
    print("\nWhere it is spent: nbwatch's own time on the training thread (time/nbwatch) as "
          "the ratio step / (step - own), median over rounds and spread; the process's CPU "
          "a step (every thread) over the same round's bare loop's")
    print("| variant | own ms/step (median) | ratio from own time (median) | spread | "
          "CPU a step over bare (median) | spread |")
    print("|---|---|---|---|---|---|")
    for name, rounds in results.items():
        if name.startswith("bare") or not any(r.own for r in rounds):
            continue
        own_ms = statistics.median(r.own * r.step * 1e3 for r in rounds)
        ratio = [1 / (1 - r.own) for r in rounds]
        cpu = [r.cpu / b.cpu for r, b in zip(rounds, results["bare"])]
        print(f"| {name} | {own_ms:.3f} | {statistics.median(ratio):.4f}x | "
              f"{min(ratio):.4f}–{max(ratio):.4f} | {statistics.median(cpu):.3f}x | "
              f"{min(cpu):.3f}–{max(cpu):.3f} |")

if __name__ == "__main__":
    main()
