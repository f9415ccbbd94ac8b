"""What update ratios every step (`update_every=1`) cost a training step: the copy of the
weights before the update and ‖ΔW‖/‖W‖ per layer after it (`probes.weights.snapshot`,
`update_ratios`), on the tensors nbwatch uses.

    python benchmarks/update_ratio_cost.py [--rounds 9]

For the demo's TinyGPT (d=128, 4 layers, vocabulary 96) and a GPT-2-shaped TinyGPT (d=768,
12 layers, 12 heads, vocabulary 8,192): a bare training step (forward, masked
cross-entropy, backward, AdamW) on a batch of 8 × 128 tokens, and the ratio's own work
around the same optimizer step, timed in the same rounds, one thread. Prints the medians
and the ratio's share of the bare step; the extra memory is one copy of the weights.
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
from nbwatch.probes import weights  # noqa: E402
from nbwatch.probes.grads import Layers  # noqa: E402
from nbwatch.probes.loss import masked_cross_entropy  # noqa: E402

B, T = 8, 128
SHAPES = {"demo (d=128 × 4)": dict(vocab=96, d=128, layers=4, heads=4),
          "GPT-2-shaped (d=768 × 12)": dict(vocab=8192, d=768, layers=12, heads=12)}


def case(shape: dict, rounds: int) -> tuple[float, float, int]:
    """(bare step s, ratio work s, parameters): medians over `rounds`."""
    torch.manual_seed(0)
    model = TinyGPT(ctx=T, **shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    layers = Layers.of(model)
    ids = torch.randint(1, shape["vocab"], (B, T + 1))
    x, y, mask = ids[:, :-1], ids[:, 1:], torch.ones(B, T)
    steps, extra = [], []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        loss = masked_cross_entropy(model(x), y, mask)
        loss.backward()
        t1 = time.perf_counter()
        before = weights.snapshot(layers)
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        ratios = weights.update_ratios(layers, before).tolist()
        t4 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t5 = time.perf_counter()
        assert len(ratios) == len(layers)
        if r:  # the first is a warm-up
            steps.append((t1 - t0) + (t3 - t2) + (t5 - t4))
            extra.append((t2 - t1) + (t4 - t3))
    return statistics.median(steps), statistics.median(extra), sum(
        p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"one thread, batch {B} × {T}, AdamW, {args.rounds} rounds (medians)")
    print("| model | parameters | bare step ms | ratios every step ms | share |")
    print("|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        step, extra, n = case(shape, args.rounds)
        print(f"| {name} | {n / 1e6:.1f}M | {step * 1e3:.1f} | {extra * 1e3:.2f} | "
              f"{extra / step:.1%} |", flush=True)


if __name__ == "__main__":
    main()
