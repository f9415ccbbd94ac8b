"""The run store at scale: write rate, bytes per scalar, `.df` time and peak memory.

A synthetic run shaped like a real one (loss, LR, global and per-layer grad norms,
update ratios, timings, data figures) goes through the public write path
(`RunStore.put(Scalars)` from a producer thread, as the recorder does) and is read back
through `nbwatch.open_run(...)`. Every read runs in a fresh subprocess, so its peak
memory (the peak RSS above the process's size after imports) is its own.

    python benchmarks/store.py                       # 100k × 25, 1M × 25, 1M × 300
    python benchmarks/store.py --runs 100000x25      # one shape
    python benchmarks/store.py --keep /tmp/stores    # keep the run folders
    python benchmarks/store.py --commit-steps 20     # a live run: a commit every 20 steps

Prints one row per run: scalars written, write rate (scalars/s), put() stall (the time
the producer spent blocked by back-pressure), bytes on disk per scalar, `.df` seconds and
peak MiB over the frame's own size, a partial read, the late-view state (`Feed.full`)
and the HTML export.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def keys_for(width: int) -> list[str]:
    """`width` scalar names: 9 run-level ones, the rest per-layer grad norms and ratios."""
    base = ["loss/train", "lr/group0", "grad_norm/global", "time/step", "time/data",
            "throughput/tokens_per_s", "data/padding_ratio", "data/seq_len_mean", "tokens/real"]
    layers = (width - len(base)) // 2
    keys = base + [f"grad_norm/blocks.{i}" for i in range(layers)]
    keys += [f"update_ratio/blocks.{i}" for i in range(width - len(keys))]
    return keys


def write(run_dir: Path, steps: int, width: int, commit_steps: int = 0) -> dict:
    from nbwatch.records import Scalars
    from nbwatch.store import RunStore

    keys = keys_for(width)
    rng = np.random.default_rng(0)
    block = rng.standard_normal((1000, width)).tolist()  # values vary, cost does not
    store = RunStore(run_dir)
    stalled = 0.0
    t0 = time.perf_counter()
    wall = time.time()
    for step in range(1, steps + 1):
        row = block[step % 1000]
        p0 = time.perf_counter()
        store.put(Scalars(step, dict(zip(keys, row)), wall + step * 1e-3))
        stalled += max(time.perf_counter() - p0 - 20e-6, 0.0)  # a put is µs unless blocked
        if commit_steps and step % commit_steps == 0:
            store.flush()  # a live run: a commit every few steps, so small blocks
    store.flush(timeout=600)
    seconds = time.perf_counter() - t0
    c0 = time.perf_counter()
    store.close()
    close_s = time.perf_counter() - c0
    size = sum(p.stat().st_size for p in run_dir.iterdir() if p.name.startswith("nbwatch.db"))
    left = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("nbwatch.db-"))
    n = steps * width
    return {"scalars": n, "write_per_s": n / seconds, "stall_s": stalled,
            "bytes_per_scalar": size / n, "mib": size / 2**20, "left_beside_db": left,
            "close_s": close_s}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak() -> int:
    """Reset the peak RSS (Linux: VmHWM) to the current size, so imports do not count."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def child(what: str, run_dir: str) -> None:
    """One read in this fresh process; prints JSON."""
    import nbwatch

    base = _reset_peak()
    t0 = time.perf_counter()
    out: dict = {}
    if what == "df":
        df = nbwatch.open_run(run_dir).df
        out["frame_mib"] = df.memory_usage(deep=True).sum() / 2**20
        out["shape"] = list(df.shape)
    elif what == "partial":
        run = nbwatch.open_run(run_dir)
        last = run.step
        df = run.scalars(keys=["loss/train"], start=last - 10_000, stop=last)
        out["shape"] = list(df.shape)
    elif what == "feed":
        from nbwatch.panels import Feed
        from nbwatch.store import RunReader

        feed = Feed(RunReader(run_dir))
        while feed.update() is not None or feed.more:
            pass
        state = feed.full()
        out["json_mib"] = len(json.dumps(state, default=str)) / 2**20
    elif what == "export":
        path = nbwatch.open_run(run_dir).export_html(Path(run_dir) / "run.html")
        out["html_mib"] = path.stat().st_size / 2**20
    out["seconds"] = time.perf_counter() - t0
    out["peak_mib"] = (_status_kib("VmHWM") - base) / 1024
    print(json.dumps(out))


def read(what: str, run_dir: Path) -> dict:
    res = subprocess.run([sys.executable, __file__, "--child", what, str(run_dir)],
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr else "failed"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="*", default=["100000x25", "1000000x25", "1000000x300"])
    ap.add_argument("--reads", nargs="*", default=["df", "partial", "feed", "export"])
    ap.add_argument("--keep", type=Path, default=None)
    ap.add_argument("--commit-steps", type=int, default=0,
                    help="commit every N steps, as a live run does (0: as fast as it can)")
    ap.add_argument("--child", nargs=2, metavar=("WHAT", "RUN_DIR"))
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    root = args.keep or Path(tempfile.mkdtemp(prefix="nbwatch-store-"))
    try:
        for shape in args.runs:
            steps, width = (int(x) for x in shape.split("x"))
            run_dir = root / shape
            shutil.rmtree(run_dir, ignore_errors=True)
            w = write(run_dir, steps, width, args.commit_steps)
            print(f"{shape}: wrote {w['scalars']:,} scalars at {w['write_per_s'] / 1e6:.2f}M/s"
                  f" (put() blocked {w['stall_s']:.2f} s), {w['mib']:.1f} MiB on disk ="
                  f" {w['bytes_per_scalar']:.2f} B/scalar; close (compaction) {w['close_s']:.2f} s;"
                  " beside the .db: "
                  f"{w['left_beside_db'] or 'nothing'}", flush=True)
            for what in args.reads:
                r = read(what, run_dir)
                if "error" in r:
                    print(f"  {what}: {r['error']}", flush=True)
                    continue
                extra = ""
                if "frame_mib" in r:
                    extra = (f", frame {r['frame_mib']:.0f} MiB, peak/frame "
                             f"{r['peak_mib'] / max(r['frame_mib'], 1e-9):.2f}×")
                print(f"  {what}: {r['seconds']:.2f} s, peak +{r['peak_mib']:.0f} MiB{extra}",
                      flush=True)
            if args.keep is None:
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
