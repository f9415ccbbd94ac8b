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
    python benchmarks/store.py --runs 60layer demo   # whole folders: histograms, attention
    python benchmarks/store.py --baseline            # each run again as schema 3 wrote it

`60layer` (40k steps of a 60-layer model, d=256) and `demo` (1,000 steps of the demo's
4-layer d=128 GPT) write what a monitored run writes, through the same `put()`: the
recorder's per-step scalars, update ratios, weight and sequence-length histograms every 50
steps (64 and 32 bins, counts of real weight tensors' histograms), and at each eval (every
1,000 and 100 steps) the probe figures and two samples' attention maps (4 heads × 64
tokens, causal softmax), committing after each histogram step as a live run does. They
print the whole folder's bytes per recorded scalar and each table's share.

Prints one row per run: scalars written, write rate (scalars/s), put() stall (the time
the producer spent blocked by back-pressure), bytes on disk per scalar, `.df` seconds and
peak MiB over the frame's own size, a partial read, the late-view state (`Feed.full`)
and the HTML export. The `.df` is the median of `--df-rounds` (3) reads, each in a fresh
process right after a baseline: a fresh process filling a buffer of the frame's size (see
`df_rounds`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import shutil
import statistics
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


def schema_3() -> None:
    """Histogram counts written as schema 3 wrote them (zlib-packed as they lie): the
    baseline of `--baseline`."""
    from functools import partial

    from nbwatch.store import histograms

    histograms.encode_counts = partial(histograms.encode_counts, planes=False)


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


# name: (steps, {layer: parameter count}, attention modules, hist_every, eval_every)
def _gpt_layers(d: int, blocks: int, embeddings: bool) -> dict[str, int]:
    per = {"ln1": 2 * d, "attn.qkv": 3 * d * d + 3 * d, "attn.proj": d * d + d,
           "ln2": 2 * d, "mlp.fc": 4 * d * d + 4 * d, "mlp.proj": 4 * d * d + d}
    out = {"tok_emb": 128 * d, "pos_emb": 128 * d} if embeddings else {}
    out.update({f"blocks.{i}.{k}": n for i in range(blocks) for k, n in per.items()})
    if embeddings:
        out.update({"ln_f": 2 * d, "head": 128 * d})
    return out


FOLDERS = {
    "60layer": (40_000, _gpt_layers(256, 10, embeddings=False), 10, 50, 1000),
    "demo": (1_000, _gpt_layers(128, 4, embeddings=True), 4, 50, 100),
}
HEADS, TOKENS = 4, 64


class _Histograms:
    """Per layer, a histogram of normal weights of the layer's size, made as the recorder
    makes it (64 bins, float32 edges); each step's is new: its range moved a little and
    its counts drawn again from the same bins (a multinomial), as training moves both."""

    def __init__(self, layers: dict[str, int]):
        import torch

        from nbwatch.probes.weights import histogram

        self._histogram = histogram
        g = torch.Generator().manual_seed(0)
        self.base = []
        for n in layers.values():
            e, c = histogram(torch.randn(n, generator=g) * 0.02, 64)
            self.base.append((float(e[0]), float(e[-1]), n, c.numpy() / n))
        self.rng = np.random.default_rng(0)

    def step(self) -> list[tuple[np.ndarray, np.ndarray]]:
        import torch

        out = []
        for lo, hi, n, p in self.base:
            scale = 1 + 0.01 * self.rng.standard_normal()
            ends = torch.tensor([lo * scale, hi * scale], dtype=torch.float32)
            e, _ = self._histogram(ends, 64)
            out.append((e.double().numpy(), self.rng.multinomial(n, p)))
        return out


def _seq_len_histogram() -> tuple[np.ndarray, np.ndarray]:
    """The sequence lengths of 50 steps of 16 samples, binned as the recorder bins them."""
    import torch

    from nbwatch.probes.weights import histogram

    lengths = torch.randint(8, 129, (800,), generator=torch.Generator().manual_seed(0))
    e, c = histogram(lengths.float(), 32)
    return e.double().numpy(), c.numpy()


def _attention_maps(modules: int, variants: int = 4) -> list[np.ndarray]:
    """Causal softmax maps [heads, T, T], sharper or flatter."""
    rng = np.random.default_rng(0)
    mask = np.triu(np.ones((TOKENS, TOKENS), dtype=bool), 1)
    out = []
    for v in range(variants * modules):
        s = rng.standard_normal((HEADS, TOKENS, 16)) @ rng.standard_normal(
            (HEADS, 16, TOKENS)) * (0.25 + v % 8) / 4
        s[:, mask] = -np.inf
        e = np.exp(s - s.max(-1, keepdims=True))
        out.append((e / e.sum(-1, keepdims=True)).astype(np.float32))
    return out


def write_folder(run_dir: Path, shape: str) -> dict:
    """A monitored run's records, written as the recorder writes them (see the top)."""
    from nbwatch.records import Attention, Histogram, Scalars, SystemSample
    from nbwatch.store import RunStore

    steps, layers, n_att, hist_every, eval_every = FOLDERS[shape]
    names = list(layers)
    att = [f"blocks.{i}.attn" for i in range(n_att)]
    step_keys = (["loss/train", "tokens/real", "data/seq_len_mean", "data/seq_len_max",
                  "data/padding_ratio", "grad_norm/global"] + [f"grad_norm/{n}" for n in names]
                 + ["grad_norm/clipped", "lr"])
    timing = ["time/forward_backward", "time/forward", "time/probes", "time/optimizer",
              "time/step", "time/data", "time/compute", "throughput/samples_per_s",
              "throughput/tokens_per_s"]
    ratios = [f"update_ratio/{n}" for n in names]
    evals = (["loss/val", "loss/gap", "time/eval"]
             + [f"attn/{f}/{m}{h}" for f in ("entropy", "max_logit") for m in att
                for h in ["", *(f"/{i}" for i in range(HEADS))]]
             + [f"act/rms/blocks.{i}" for i in range(n_att)] + ["logits/z_mean", "logits/max_abs"])
    system = ["system/cpu/util", "system/ram/used_gb", "system/ram/total_gb",
              "system/proc/rss_gb"]
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((1000, len(step_keys) + len(timing) + len(ratios) + len(evals)))
    hists = _Histograms(layers)
    seq = _seq_len_histogram()
    maps = _attention_maps(n_att)
    tokens = tuple(chr(33 + i % 90) for i in range(TOKENS))
    store = RunStore(run_dir)
    scalars = 0
    wall = time.time()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        row = pool[step % 1000].tolist()
        keys = step_keys + timing
        if step % hist_every == 0 or step == 1:
            keys = step_keys + ratios + timing
        if step % eval_every == 0:
            keys = keys + evals
        store.put(Scalars(step, dict(zip(keys, row)), wall + step * 0.05))
        scalars += len(keys)
        if step % 20 == 0:
            store.put(SystemSample(dict(zip(system, row)), step, wall + step * 0.05))
            scalars += len(system)
        if step % hist_every == 0 or step == 1:
            for name, (e, c) in zip(names, hists.step()):
                store.put(Histogram(step, f"weight/{name}", e, c))
            store.put(Histogram(step, "data/seq_len", *seq))
            store.flush()  # a live run commits every 0.2 s: one histogram step a commit
        if step % eval_every == 0:
            for sample in range(2):
                for i, m in enumerate(att):
                    w = maps[(step // eval_every + sample + i) % len(maps)]
                    store.put(Attention(step, m, sample, w, tokens))
    store.flush(timeout=600)
    write_s = time.perf_counter() - t0
    c0 = time.perf_counter()
    store.close()
    close_s = time.perf_counter() - c0
    db = run_dir / "nbwatch.db"
    import sqlite3

    con = sqlite3.connect(db)
    try:
        share = {}
        for name, size in con.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"):
            table = {"histograms_name_step": "histograms", "attention_step": "attention"}.get(
                name, name)
            share[table] = share.get(table, 0) + size
    except sqlite3.OperationalError:  # an SQLite built without dbstat
        share = {}
    finally:
        con.close()
    size = sum(p.stat().st_size for p in run_dir.iterdir() if p.name.startswith("nbwatch.db"))
    return {"scalars": scalars, "bytes_per_scalar": size / scalars, "mib": size / 2**20,
            "write_s": write_s, "close_s": close_s,
            "share": {k: v / scalars for k, v in sorted(share.items(), key=lambda kv: -kv[1])
                      if v / scalars >= 0.05}}


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
    if what.startswith("touch"):  # the baseline: a fresh float64 buffer of the frame's size
        rows, cols = (int(x) for x in what[5:].split("x"))
        buf = np.empty((cols, rows))
        buf.fill(1.0)
        out["frame_mib"] = buf.nbytes / 2**20
    elif what == "df":
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


def df_rounds(run_dir: Path, steps: int, width: int, rounds: int) -> None:
    """`.df` in fresh processes, each after the baseline: a fresh process that fills a
    float64 buffer of the frame's size. On this machine (a VM) the first touch of a few
    GiB of memory after a large write costs up to ~6 s and a moment later ~0.3 s: the
    machine's cost, not the read's, so a throwaway fill goes first and each round prints
    both."""
    read(f"touch{steps}x{width}", run_dir)  # warm-up: not counted
    dfs, touches, r = [], [], {}
    for _ in range(rounds):
        t = read(f"touch{steps}x{width}", run_dir)
        r = read("df", run_dir)
        if "error" in r or "error" in t:
            print(f"  df: {r.get('error') or t.get('error')}", flush=True)
            return
        dfs.append(r["seconds"])
        touches.append(t["seconds"])
    med = statistics.median(dfs)
    print(f"  df: {med:.2f} s (median of {rounds}: {', '.join(f'{d:.2f}' for d in dfs)} s), "
          f"peak +{r['peak_mib']:.0f} MiB, frame {r['frame_mib']:.0f} MiB, peak/frame "
          f"{r['peak_mib'] / max(r['frame_mib'], 1e-9):.2f}×; baseline (a fresh process "
          f"filling a buffer of the frame's size) {statistics.median(touches):.2f} s "
          f"({', '.join(f'{d:.2f}' for d in touches)})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="*", default=["100000x25", "1000000x25", "1000000x300"])
    ap.add_argument("--reads", nargs="*", default=["df", "partial", "feed", "export"])
    ap.add_argument("--keep", type=Path, default=None)
    ap.add_argument("--df-rounds", type=int, default=3,
                    help="`.df` reads, each after the baseline's (median and spread)")
    ap.add_argument("--commit-steps", type=int, default=0,
                    help="commit every N steps, as a live run does (0: as fast as it can)")
    ap.add_argument("--baseline", action="store_true",
                    help="also write each run as schema 3 did (histogram counts zlib-packed as"
                         " they lie), after this one, and read it the same way: a baseline in"
                         " the same run")
    ap.add_argument("--schema-3", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=2, metavar=("WHAT", "RUN_DIR"))
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.schema_3:
        schema_3()
    if args.baseline:  # the same invocation without --baseline, then with --schema-3
        base = [a for a in sys.argv[1:] if a != "--baseline"]
        for extra in ([], ["--schema-3"]):
            print("# schema 4" if not extra else "# schema 3's encodings", flush=True)
            subprocess.run([sys.executable, __file__, *base, *extra], check=True)
        return
    root = args.keep or Path(tempfile.mkdtemp(prefix="nbwatch-store-"))
    try:
        for shape in args.runs:
            if shape in FOLDERS:
                run_dir = root / shape
                shutil.rmtree(run_dir, ignore_errors=True)
                f = write_folder(run_dir, shape)
                parts = ", ".join(f"{k} {v:.2f}" for k, v in f["share"].items())
                print(f"{shape}: {f['scalars']:,} scalars, {f['mib']:.1f} MiB on disk ="
                      f" {f['bytes_per_scalar']:.2f} B/scalar (B/scalar by table: {parts});"
                      f" written in {f['write_s']:.1f} s, close {f['close_s']:.2f} s", flush=True)
                if args.keep is None:
                    shutil.rmtree(run_dir, ignore_errors=True)
                continue
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
                if what == "df":
                    df_rounds(run_dir, steps, width, args.df_rounds)
                    continue
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
