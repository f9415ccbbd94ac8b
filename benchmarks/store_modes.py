"""Write throughput of the store's two modes: "local" (WAL, synchronous=NORMAL) and
"network" (rollback journal, synchronous=FULL, a heartbeat file), on the same disk.

The disk is this machine's, so the ratio is what the journal and the syncs cost, not a
file server's latency (on NFS each sync is a round trip to the server as well). Rounds of
the two modes are interleaved; each writes `--steps` steps of `--width` scalars through
`RunStore.put` and commits every `--commit-steps` steps (a live run commits every 0.2 s),
then closes. Prints the median and range of steps/s per mode and the median ratio.

    python benchmarks/store_modes.py
    python benchmarks/store_modes.py --steps 2000 --width 50 --commit-steps 1 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from nbwatch.records import Scalars
from nbwatch.store import RunStore


def one_round(folder: Path, mode: str, steps: int, width: int, every: int) -> float:
    """steps/s of one run written in `mode` (open to close)."""
    keys = [f"grad_norm/layer{i}" for i in range(width - 1)] + ["loss/train"]
    t0 = time.perf_counter()
    store = RunStore(folder, mode=mode, flush_interval=3600)
    for step in range(1, steps + 1):
        store.put(Scalars(step, {k: 1.0 / step for k in keys}))
        if step % every == 0:
            store.flush()
    store.close()
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--width", type=int, default=50)
    ap.add_argument("--commit-steps", type=int, nargs="+", default=[1, 20])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for every in args.commit_steps:
            rates: dict[str, list[float]] = {"local": [], "network": []}
            for r in range(args.rounds):
                for mode in rates:
                    rates[mode].append(one_round(Path(tmp) / f"{mode}-{every}-{r}", mode,
                                                 args.steps, args.width, every))
            med = {m: statistics.median(v) for m, v in rates.items()}
            for m, v in rates.items():
                print(f"commit every {every:>3} steps  {m:8s} {med[m]:9.0f} steps/s "
                      f"(range {min(v):.0f}–{max(v):.0f}, {args.rounds} rounds)")
            print(f"commit every {every:>3} steps  network/local = "
                  f"{med['network'] / med['local']:.2f}")


if __name__ == "__main__":
    main()
