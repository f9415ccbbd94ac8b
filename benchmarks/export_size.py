"""Size and time of the HTML export of a long run.

    python benchmarks/export_size.py                 # 1,000,000 steps (target: < 8 MB)
    python benchmarks/export_size.py --steps 100000  # quicker

A synthetic run is written straight through `RunStore`: 25 scalars a step (loss, LR, global
and post-clip grad norm, 10 per-layer grad norms, throughput, step-time split, padding,
sequence length, real tokens…), system figures every 10 steps, an eval (val loss, gap) every
1,000, weight histograms of 10 layers and their update ratios every 50, a checkpoint event
every 10,000, attention maps (5 layers × 4 heads × 48², 2 samples) every 100,000, a few
alerts and actions, a sample at each eval. Then `export_html` writes the
page; the figure printed is its size, split into plotly.js, the app and the run's state.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nbwatch.export import export_html  # noqa: E402
from nbwatch.records import Attention, Event, Histogram, Sample, Scalars  # noqa: E402
from nbwatch.store import RunStore  # noqa: E402

LAYERS = [f"blocks.{i}.{m}" for i in range(5) for m in ("attn", "mlp")]
TARGET_MB = 8.0


def write_run(run_dir: Path, steps: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    store = RunStore(run_dir)
    t0 = time.time() - steps * 0.1
    meta = {"name": "bench-1m", "state": "running", "max_steps": steps, "started": t0,
            "config": {"lr": 3e-4, "batch_size": 64, "layers": 5, "d": 512},
            "environment": {"python": sys.version.split()[0], "bench": True},
            "run": {"model": "GPT", "optimizer": "AdamW", "scheduler": "LambdaLR",
                    "parameters": 25_000_000}}
    for k, v in meta.items():
        store.set_meta(k, v)
    edges = np.linspace(-0.1, 0.1, 65)
    chunk = 10_000
    for first in range(1, steps + 1, chunk):
        s = np.arange(first, min(first + chunk, steps + 1))
        n = len(s)
        noise = rng.standard_normal((n, 8))
        loss = 3.0 / (1 + s / 5e4) + 0.05 * noise[:, 0]
        loss[rng.random(n) < 1e-4] += 3.0  # rare spikes the downsample must keep
        gn = 1 + 0.1 * noise[:, 1]
        layer_gn = np.abs(0.1 + 0.02 * rng.standard_normal((n, len(LAYERS))))
        for i, step in enumerate(s.tolist()):
            v = {"loss/train": loss[i], "lr": 3e-4 * min(1.0, step / 2000),
                 "grad_norm/global": gn[i], "grad_norm/clipped": min(gn[i], 1.0),
                 "throughput/tokens_per_s": 5e4 + 1e3 * noise[i, 2], "time/step": 0.1,
                 "time/data": 0.01 + 0.001 * noise[i, 3], "time/compute": 0.09,
                 "data/padding_ratio": 0.2 + 0.02 * noise[i, 4], "data/seq_len_mean": 90.0,
                 "data/seq_len_max": 128.0, "tokens/real": 5000.0 + 50 * noise[i, 5],
                 "loss/train_tokens": 5000.0, "step/accumulated": 1.0,
                 "optim/step_skipped": 0.0}
            v.update({f"grad_norm/{m}": layer_gn[i, j] for j, m in enumerate(LAYERS)})
            if step % 50 == 0:
                v.update({f"update_ratio/{m}": 1e-3 * (1 + j) for j, m in enumerate(LAYERS)})
            if step % 1000 == 0:
                v["loss/val"] = loss[i] + 0.1
                v["loss/gap"] = 0.1
            store.put(Scalars(step, {k: float(x) for k, x in v.items()}, wall=t0 + step * 0.1))
            if step % 10 == 0:
                store.put(Scalars(step, {"system/cpu/util": 50.0, "system/ram/used_gb": 8.0,
                                         "system/ram/total_gb": 64.0}, wall=t0 + step * 0.1))
            if step % 50 == 0:
                for j, m in enumerate(LAYERS):
                    counts = rng.integers(0, 1000, 64)
                    store.put(Histogram(step, f"weight/{m}", edges * (1 + j / 10), counts))
                store.put(Histogram(step, "data/seq_len", np.linspace(0, 128, 33),
                                    rng.integers(0, 100, 32)))
            if step % 1000 == 0:
                store.put(Sample(step, f"def f(x):  # step {step}", wall=t0 + step * 0.1))
            if step % 100_000 == 0:  # attention probes: the page shows the newest eval's
                att = rng.random((2, 4, 48, 48)).astype(np.float32)
                att /= att.sum(-1, keepdims=True)
                toks = tuple(f"t{k}" for k in range(48))
                for m in LAYERS[::2]:
                    for sample in range(2):
                        store.put(Attention(step, m, sample, att[sample], toks))
            if step % 10_000 == 0:
                store.put(Event(step, "checkpoint", "info", f"periodic checkpoint at {step}",
                                {"path": f"checkpoints/step_{step:08d}.pt", "bytes": 3e8,
                                 "seconds": 1.2, "best": False, "reason": "periodic"}))
            if step % 97_000 == 0:
                store.put(Event(step, "alert", "warning", f"loss spike at step {step}", {}))
                store.put(Event(step, "action", "info", "clip set to 1.0",
                                {"command": "clip", "value": 1.0}))
        store.flush()  # bounded memory: one chunk queued at a time
        print(f"\r  wrote {s[-1]:,d} steps", end="", flush=True)
    store.set_meta("state", "finished")
    store.set_meta("step", steps)
    store.close()
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--keep", default=None, help="write the run and the page under this folder")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        run = base / "run"
        t0 = time.perf_counter()
        write_run(run, args.steps)
        t_write = time.perf_counter() - t0
        db_mb = sum(p.stat().st_size for p in run.glob("nbwatch.db*")) / 2**20
        t0 = time.perf_counter()
        out = export_html(run, base / "run.html")
        t_export = time.perf_counter() - t0
        text = out.read_text(encoding="utf-8")
        size = out.stat().st_size / 2**20
        parts = {name: len(text.split(f'id="{name}"', 1)[1].split("</script>", 1)[0]) / 2**20
                 for name in ("nbw-state", "nbw-plotly")}
        print(f"{args.steps:,d} steps | store {db_mb:,.0f} MB written in {t_write:.0f} s | "
              f"export {size:.2f} MB in {t_export:.1f} s (state {parts['nbw-state']:.2f} MB, "
              f"plotly.js {parts['nbw-plotly']:.2f} MB) | target < {TARGET_MB:g} MB: "
              f"{'ok' if size < TARGET_MB else 'OVER'}")


if __name__ == "__main__":
    main()
