"""What the per-step logits statistic (`train_logits/log_z`, `train_logits/max_abs`:
`probes.logits.logit_parts`, at most 64 positions) costs a training step, by vocabulary.

    python benchmarks/logits_cost.py [--vocabs 96 50000 150000] [--rounds 9]

For each vocabulary, a TinyGPT (d=128, 2 layers) training step on a batch of 8 × 128
tokens (forward, masked cross-entropy, backward, AdamW): the bare step and the step with
the statistic, interleaved in rounds of 3 steps each in one process, one thread; the
median ratio of the rounds and its spread; and the statistic alone on that step's logits
(median of 20 calls) against the bare step's median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nbwatch.demo import TinyGPT  # noqa: E402
from nbwatch.probes.logits import logit_parts  # noqa: E402
from nbwatch.probes.loss import masked_cross_entropy  # noqa: E402

B, T = 8, 128


def case(vocab: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=vocab, d=128, layers=2, heads=4, ctx=T)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(1, vocab, (B, T + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    mask = torch.ones(B, T)
    kept: list[torch.Tensor] = []

    def step(stat: bool) -> float:
        t0 = time.perf_counter()
        logits = model(x)
        parts = logit_parts(logits, mask) if stat else []
        masked_cross_entropy(logits, y, mask).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if parts:
            kept.append(torch.stack(parts))  # the host copy rides on the step's own
        return time.perf_counter() - t0

    for _ in range(2):
        step(False), step(True)
    bare, ratios = [], []
    for _ in range(rounds):
        a = [step(False) for _ in range(3)]
        b = [step(True) for _ in range(3)]
        bare += a
        ratios.append(statistics.median(b) / statistics.median(a))
    with torch.no_grad():
        logits = model(x)
    alone = []
    for _ in range(23):
        t0 = time.perf_counter()
        logit_parts(logits, mask)
        alone.append(time.perf_counter() - t0)
    step_s = statistics.median(bare)
    return {"step_ms": 1e3 * step_s, "stat_ms": 1e3 * statistics.median(alone[3:]),
            "ratio": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios),
            "alone_ratio": 1 + statistics.median(alone[3:]) / step_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocabs", type=int, nargs="+", default=[96, 50_000, 150_000])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"TinyGPT d=128 × 2 layers, batch {B}×{T}, AdamW, 1 thread; "
          f"{args.rounds} interleaved rounds of 3 steps")
    print(f"{'vocab':>8} {'step ms':>9} {'stat ms':>8} {'1+stat/step':>12} "
          f"{'with/without (median, range)':>30}")
    for v in args.vocabs:
        r = case(v, args.rounds)
        print(f"{v:>8,} {r['step_ms']:>9.1f} {r['stat_ms']:>8.2f} {r['alone_ratio']:>12.4f} "
              f"{r['ratio']:>12.3f} ({r['lo']:.3f}–{r['hi']:.3f})", flush=True)


if __name__ == "__main__":
    main()
