"""The alert engine's cost a step, per rule, fed the figures of a real run.

Replays tests/data/healthy_demo.npz (a recorded 5,000-step demo run: every per-step
figure the recorder gives the engine) through `AlertEngine.observe`'s "grads" and "step"
phases, as the recorder calls them, and times each rule's check and the engine's own
work (the window, the spike score, episodes). Prints µs a step.

    python benchmarks/alert_cost.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from nbwatch.alerts import AlertEngine, default_rules

FIXTURE = Path(__file__).parent.parent / "tests" / "data" / "healthy_demo.npz"


def steps() -> list[tuple[int, dict[str, float]]]:
    d = np.load(FIXTURE)
    cols = list(d["columns"])
    out = []
    for step, row in zip(d["steps"].tolist(), d["scalars"]):
        values = {c: float(v) for c, v in zip(cols, row) if not np.isnan(v)}
        for k in ("loss/val", "loss/gap", "time/eval"):
            values.pop(k, None)
        out.append((step, values))
    return out


def one_round(data: list[tuple[int, dict[str, float]]]) -> tuple[float, dict[str, float]]:
    """(µs a step for both phases, {rule: µs a step in its check})."""
    eng = AlertEngine(default_rules())
    spent: dict[str, float] = defaultdict(float)
    for rule in eng.rules:  # time each check where the engine calls it
        check = rule.check

        def timed(w, p, _check=check, _name=rule.name):
            t = time.perf_counter()
            try:
                return _check(w, p)
            finally:
                spent[_name] += time.perf_counter() - t
        object.__setattr__(rule, "check", timed)
    t0 = time.perf_counter()
    for step, values in data:
        eng.observe("grads", step, values)
        eng.explain_lr()
        eng.observe("step", step, dict(values))
    total = (time.perf_counter() - t0) / len(data) * 1e6
    return total, {k: v / len(data) * 1e6 for k, v in spent.items()}


def bare_round(data: list[tuple[int, dict[str, float]]]) -> float:
    """The same loop with no rules: the engine's own work (window, spike score)."""
    eng = AlertEngine([])
    t0 = time.perf_counter()
    for step, values in data:
        eng.observe("grads", step, values)
        eng.observe("step", step, dict(values))
    return (time.perf_counter() - t0) / len(data) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    data = steps()
    totals, bares, per = [], [], defaultdict(list)
    for _ in range(args.rounds):
        total, rules = one_round(data)
        totals.append(total)
        bares.append(bare_round(data))
        for k, v in rules.items():
            per[k].append(v)
    print(f"{len(data)} steps x {args.rounds} rounds, {len(data[0][1])} figures a step; "
          "medians (µs a step; per-rule timing adds its own ~0.2 µs a check)")
    print(f"engine, both phases, default rules: {statistics.median(totals):.1f} µs")
    print(f"engine with no rules (window, spike score): {statistics.median(bares):.1f} µs")
    for k, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {k:24s} {statistics.median(v):6.2f} µs")


if __name__ == "__main__":
    main()
