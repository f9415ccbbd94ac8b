"""On a CUDA machine: a short monitored training in both modes, checked for what only a GPU
shows. Exits 0 with a message where there is no CUDA.

  1. device→host syncs per step, counted by `torch.cuda.set_sync_debug_mode("warn")`:
     at most one a step outside histogram and eval steps, for `start()` and for a loop of
     the user's own with `mon.log()` (whose loss is copied with the next step's norms);
  2. the NVML gauges read real values (utilisation, memory, temperature/power);
  3. the overhead: ms/step of the bare loop, of `mon.run(train)` and of `mon.start()`,
     interleaved rounds, as ratios.

    python benchmarks/gpu_check.py [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

import nbwatch
from nbwatch.demo import TinyGPT, masked_cross_entropy


def make(device: str, seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=512, d=512, layers=8, heads=8, ctx=256).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    g = torch.Generator(device="cpu").manual_seed(seed)
    batches = []
    for _ in range(8):
        ids = torch.randint(1, 512, (16, 256), generator=g)
        lengths = torch.randint(64, 257, (16,), generator=g)
        mask = (torch.arange(256)[None, :] < lengths[:, None]).long()
        batches.append({k: v.to(device) for k, v in
                        {"input_ids": ids, "labels": ids.roll(-1, 1), "mask": mask}.items()})
    return model, opt, sched, batches


def step_fn(model, b):
    return {"logits": model(b["input_ids"]), "labels": b["labels"], "mask": b["mask"]}


def train(model, opt, sched, batches, n, mon=None):
    for i in range(n):
        b = batches[i % len(batches)]
        loss = masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if mon is not None:
            mon.log(loss=loss, mask=b["mask"])


class SyncCounter:
    """Counts CUDA sync warnings per recorded step (any thread), between `start`/`stop`."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._show = None

    def __enter__(self) -> SyncCounter:
        self._show = warnings.showwarning

        def show(message, category, *args, **kwargs):
            if "synchroniz" in str(message):
                with self._lock:
                    self.count += 1
            else:
                self._show(message, category, *args, **kwargs)

        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        warnings.resetwarnings()


def syncs_per_step(mode: str, root: Path, steps: int) -> tuple[float, nbwatch.Monitor]:
    model, opt, sched, batches = make("cuda")
    # no histogram or eval step inside the counted window: those copy by design
    mon = nbwatch.Monitor(model, opt, sched, run_dir=root / f"sync-{mode}", display=False,
                          hist_every=10**9, system_interval=0.5)
    warm = 5
    if mode == "log":
        with mon:
            train(model, opt, sched, batches, warm, mon)
            torch.cuda.synchronize()
            with SyncCounter() as c:
                train(model, opt, sched, batches, steps, mon)
        return c.count / steps, mon
    # start(): count from the step_fn of step warm+1 to that of step warm+steps+1, so
    # that the final checkpoint (a copy of every weight) stays outside the window
    c = SyncCounter()

    def counting_step(model, b):
        if mon.step == warm:
            c.__enter__()
        elif mon.step == warm + steps:
            c.__exit__()
        return step_fn(model, b)

    mon.start(counting_step, batches, max_steps=warm + steps + 1, hist_every=10**9,
              display=False)
    mon.wait()
    return c.count / steps, mon


def overhead(root: Path, steps: int, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in range(rounds):
        for name in ("bare", "run", "start"):
            model, opt, sched, batches = make("cuda")
            train(model, opt, sched, batches, 10)  # warm
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if name == "bare":
                train(model, opt, sched, batches, steps)
            else:
                mon = nbwatch.Monitor(model, opt, sched, run_dir=root / f"{name}{r}",
                                      display=False)
                if name == "run":
                    mon.run(train, model, opt, sched, batches, steps, mon)
                else:
                    mon.start(step_fn, batches, max_steps=steps, display=False)
                mon.wait()
            torch.cuda.synchronize()
            out.setdefault(name, []).append((time.perf_counter() - t0) / steps)
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{k} {v[-1] * 1e3:.2f} ms" for k, v in out.items()), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
              "nothing to check. Run it on a machine with an NVIDIA GPU.")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for mode in ("log", "start"):
            per_step, mon = syncs_per_step(mode, root, 50)
            good = per_step <= 1.0
            ok &= good
            print(f"[{'ok' if good else 'FAIL'}] {mode}: {per_step:.2f} device→host syncs a step "
                  "(target ≤ 1)")
        df = mon.df
        gauges = [c for c in df if c.startswith("system/gpu0/")]
        util = df.get("system/gpu0/util")
        mem = df.get("system/gpu0/mem_used_gb")
        good = util is not None and mem is not None and float(mem.max()) > 0
        ok &= good
        print(f"[{'ok' if good else 'FAIL'}] NVML gauges: {', '.join(sorted(gauges)) or 'none'}"
              + (f"; util max {float(util.max()):.0f}%, memory {float(mem.max()):.2f} GB"
                 if good else ""))
        times = overhead(root, args.steps, args.rounds)
    base = statistics.median(times["bare"])
    print("| variant | ms/step (median) | ratio |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.2f} | {med / base:.3f}x |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
