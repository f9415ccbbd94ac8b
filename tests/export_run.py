"""A run folder written straight through `RunStore`, with hostile strings wherever a user or
a model puts text: run name, config keys and values, sample text, metric (layer) names,
alert messages, attention tokens. Shared by tests/test_export.py and the browser test."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from nbwatch.records import Attention, Event, Histogram, Sample, Scalars
from nbwatch.store import RunStore

SCRIPT = "<script>window.__xss = 1; alert(1)</script>"
IMG = "<img src=x onerror=\"window.__xss = 1; alert(1)\">"
HOSTILE = (SCRIPT, IMG)
LAYERS = ["blocks.0.attn", "blocks.1.mlp", f"evil{IMG}"]


def write_run(run_dir: Path, steps: int = 200, hist_every: int = 50, seed: int = 0) -> Path:
    """A finished run of `steps` steps, every panel's figures present, hostile strings in it."""
    rng = np.random.default_rng(seed)
    store = RunStore(run_dir)
    t0 = time.time() - steps * 0.1
    store.set_meta("name", f"run {SCRIPT}")
    store.set_meta("config", {"lr": 3e-4, f"key {IMG}": f"value {SCRIPT}",
                              "nested": {"note": IMG, "layers": 4}})
    store.set_meta("environment", {"python": "3.11", "host": f"host{SCRIPT}"})
    store.set_meta("max_steps", steps)
    store.set_meta("started", t0)
    store.set_meta("run", {"model": "TinyGPT", "optimizer": "AdamW", "scheduler": None,
                           "parameters": 12345})
    for s in range(1, steps + 1):
        v = {"loss/train": 4.0 * np.exp(-s / steps) + 0.1 * rng.random(),
             "lr": 3e-4 * min(1.0, s / 20), "grad_norm/global": 1.0 + rng.random(),
             "grad_norm/clipped": 1.0, "throughput/tokens_per_s": 5000.0,
             "time/step": 0.1, "time/data": 0.02, "time/compute": 0.08,
             "data/padding_ratio": 0.2 + 0.1 * rng.random(), "data/seq_len_mean": 40.0,
             "tokens/real": 100.0, "system/cpu/util": 50.0, "system/ram/used_gb": 2.0,
             "system/ram/total_gb": 16.0}
        for i, layer in enumerate(LAYERS):
            v[f"grad_norm/{layer}"] = 0.1 * (i + 1)
            v[f"update_ratio/{layer}"] = 1e-3 * (i + 1)
        v[f"train/evil{IMG}%{{x}}"] = float(s)  # a user's own scalar, named with markup
        if s % hist_every == 0:
            v["loss/val"] = 4.0 * np.exp(-s / steps) + 0.05
            v["loss/gap"] = 0.05
            v["val/accuracy"] = min(1.0, s / steps)
        store.put(Scalars(s, v, wall=t0 + s * 0.1))
        if s % hist_every == 0:
            for layer in LAYERS:
                counts = rng.integers(0, 100, 64)
                store.put(Histogram(s, f"weight/{layer}", np.linspace(-1, 1, 65), counts))
            store.put(Histogram(s, "data/seq_len", np.linspace(0, 64, 17), rng.integers(0, 9, 16)))
            store.put(Sample(s, f"step {s}: {SCRIPT} {IMG}"))
            att = rng.random((2, 6, 6)).astype(np.float32)
            att /= att.sum(-1, keepdims=True)
            for layer in LAYERS[:2]:
                store.put(Attention(s, layer, 0, att, ("a", SCRIPT, "b", IMG, "c", "d")))
            store.put(Event(s, "checkpoint", "info", f"periodic checkpoint at step {s}",
                            {"path": f"/x/checkpoints/step_{s:08d}.pt", "seconds": 0.05,
                             "bytes": 2**20, "best": s == steps, "reason": "periodic"}))
    store.put(Event(10, "alert", "warning", f"loss spike {SCRIPT}", {}))
    store.put(Event(11, "action", "info", f"clip set to 1.0 {IMG}", {"command": "clip",
                                                                        "value": 1.0}))
    store.set_meta("state", "finished")
    store.set_meta("step", steps)
    store.close()
    return run_dir
