"""The golden run of the store tests: a seeded tiny run and what the public readers return.

    PYTHONPATH=. python -m tests.store_golden tests/data    # record it again (rarely)

writes `golden_run/nbwatch.db` (the run folder as the store wrote it then) and
`golden_reads.npz` (its `df`, histograms and attention maps as the readers returned them).
`tests/test_store_golden.py` reads the folder and a fresh run of the same seed with the
current code and compares both with the recorded reads.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import torch

import nbwatch
from nbwatch.demo import TinyGPT

from .conftest import make_batches, tiny_step

STEPS = 36
# figures of the clock and the machine: they differ from run to run
VARYING = ("system/", "time/", "throughput/")


def train(run_dir: Path) -> None:
    """36 steps of a 2-layer TinyGPT, histograms every 4 steps, an eval every 12."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = make_batches(n=STEPS)
    val = batches[:2]

    def val_fn(m: torch.nn.Module) -> float:
        return float(sum(float(tiny_step(m, b)["logits"].float().mean()) for b in val))

    mon = nbwatch.Monitor(model, opt, run_dir=run_dir, display=False, hist_every=4,
                          system_interval=60.0)
    mon.start(tiny_step, batches, max_steps=STEPS, val_fn=val_fn, eval_every=12,
              probe_batch=batches[0], dry_run=False)
    mon.wait()


def reads(run_dir: Path) -> dict[str, np.ndarray]:
    """Everything the public readers return for a run, as flat arrays."""
    run = nbwatch.open_run(run_dir)
    df = run.df
    out: dict[str, np.ndarray] = {"df_index": df.index.to_numpy(),
                                  "df_columns": np.array(list(df.columns), dtype=str),
                                  "df_values": df.to_numpy(dtype=np.float64)}
    names = run.reader.histogram_names()
    out["hist_names"] = np.array(names, dtype=str)
    for i, name in enumerate(names):
        steps, edges, counts = run.histograms(name)
        out[f"hist{i}_steps"] = steps
        out[f"hist{i}_edges"] = np.stack(edges)
        out[f"hist{i}_counts"] = counts
    steps = run.reader.attention_steps()
    out["attention_steps"] = np.array(steps, dtype=np.int64)
    for step in steps:
        for sample in range(run.reader.attention_samples(step)):
            maps = run.attention(step, sample)
            out[f"att{step}_{sample}_modules"] = np.array(list(maps), dtype=str)
            for j, w in enumerate(maps.values()):
                out[f"att{step}_{sample}_{j}"] = w
            toks = run.reader.attention_tokens(step, sample)
            out[f"att{step}_{sample}_tokens"] = np.array(toks or [], dtype=str)
    return out


def main(dest: str) -> None:
    folder = Path(dest) / "golden_run"
    shutil.rmtree(folder, ignore_errors=True)
    train(folder)
    for p in folder.iterdir():  # the store alone: checkpoints and the log are not its
        if p.name != "nbwatch.db":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    np.savez_compressed(Path(dest) / "golden_reads.npz", **reads(folder))


if __name__ == "__main__":
    main(sys.argv[1])
