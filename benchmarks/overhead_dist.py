"""nbwatch's overhead under torchrun: 2 ranks (CPU, gloo), DDP and FSDP2, each as a ratio to
the same job without nbwatch.

One torchrun job per parallelism; inside it both ranks alternate rounds of the bare loop
and the same loop with `mon.log(loss=..., mask=...)` (default probes: global and per-layer
gradient norms every step, with their one collective under FSDP2; histograms and update
ratios every 50 steps; the ranks' meeting every `rank_every` steps), so that machine noise
hits both alike. A round's time is rank 0's mean step time after `--warm` steps.

    python benchmarks/overhead_dist.py [--steps 60] [--rounds 9] [--modes ddp,fsdp2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(mode: str, steps: int, warm: int, rounds: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    import nbwatch
    from nbwatch.demo import TinyGPT, collate

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, d=64, layers=4, heads=4, ctx=64)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    data = [collate([torch.randint(1, 256, (int(n),), generator=g).tolist()
                     for n in torch.randint(32, 64, (8,), generator=g)]) for _ in range(16)]

    def train(n: int, mon=None) -> list[float]:
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            b = data[i % len(data)]
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if mon is not None:
                mon.log(loss=loss, mask=b["mask"])
            times.append(time.perf_counter() - t0)
        return times

    results: dict[str, list[float]] = {"bare": [], "nbwatch": []}
    root = Path(tempfile.mkdtemp(prefix=f"nbw-dist-{mode}-"))
    for r in range(rounds):
        dist.barrier()
        results["bare"].append(statistics.mean(train(warm + steps)[warm:]))
        dist.barrier()
        run_dir = root / f"r{r}"  # the same on every rank: rank 0 writes it
        with nbwatch.Monitor(model, opt, run_dir=run_dir, display=False) as mon:
            results["nbwatch"].append(statistics.mean(train(warm + steps, mon)[warm:]))
        if rank == 0:
            print(f"{mode} round {r + 1}/{rounds}: bare {results['bare'][-1] * 1e3:.1f} ms, "
                  f"nbwatch {results['nbwatch'][-1] * 1e3:.1f} ms", flush=True)
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--modes", default="ddp,fsdp2")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warm, args.rounds, Path(args.out))
        return
    rows = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                            "--master_port=29517", str(HERE), "--worker", mode, "--out", str(out),
                            "--steps", str(args.steps), "--warm", str(args.warm),
                            "--rounds", str(args.rounds)], check=True, env=env)
            res = json.loads(out.read_text())
        ratios = [m / b for b, m in zip(res["bare"], res["nbwatch"])]
        rows.append((mode, statistics.median(res["bare"]), statistics.median(res["nbwatch"]),
                     statistics.median(ratios), min(ratios), max(ratios)))
    print(f"\n2 ranks (gloo, 1 thread each), {args.steps} steps x {args.rounds} interleaved "
          "rounds; a round's ratio = its nbwatch mean step / its bare mean step")
    print("| job | bare ms/step | nbwatch ms/step | ratio (median) | spread (min–max) |")
    print("|---|---|---|---|---|")
    for mode, b, m, med, lo, hi in rows:
        print(f"| {mode} | {b * 1e3:.1f} | {m * 1e3:.1f} | {med:.3f}x | {lo:.3f}–{hi:.3f}x |")


if __name__ == "__main__":
    main()
