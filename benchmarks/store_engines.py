"""Which embedded engine holds a run: SQLite blocks (nbwatch's store), Parquet segments,
DuckDB — measured on the same synthetic run (25 scalars a step, the store benchmark's keys).

Two workloads:
  bulk   1M steps committed 10k steps at a time: the engine's own write and read rates;
  live   100k steps committed 20 steps at a time: a run at 100 steps/s committing every
         0.2 s, as nbwatch's writer does (segments stay small unless compacted).
And one question: can another process read the run while it is written?

    pip install duckdb pyarrow          # for this benchmark only; nbwatch needs neither
    python benchmarks/store_engines.py [--bulk 1000000] [--live 100000]

Prints, per engine and workload: write rate (scalars/s), bytes per scalar, seconds to read
the whole run into a wide DataFrame, and what a second process saw while the run was
written. Numbers from one run on a 2-core machine are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from store import keys_for  # noqa: E402

KEYS = keys_for(25)
F32 = [k for k in KEYS if k.split("/")[0] in
       {"grad_norm", "update_ratio", "time", "throughput", "data"}]


def batches(steps: int, per_commit: int, pace: float = 0.0):
    rng = np.random.default_rng(0)
    block = rng.standard_normal((per_commit, len(KEYS)))
    for lo in range(1, steps + 1, per_commit):
        n = min(per_commit, steps - lo + 1)
        yield np.arange(lo, lo + n), block[:n]
        time.sleep(pace)


def frame_of(steps: np.ndarray, values: np.ndarray) -> pd.DataFrame:
    df = pd.DataFrame(values, columns=KEYS)
    df[F32] = df[F32].astype("float32")
    df.insert(0, "step", steps)
    return df


# -- engines ------------------------------------------------------------------------------
class SQLiteBlocks:
    name = "sqlite blocks (nbwatch)"

    def write(self, root: Path, steps: int, per_commit: int, pace: float = 0.0) -> None:
        from nbwatch.records import Scalars
        from nbwatch.store import RunStore

        store = RunStore(root, flush_interval=3600)  # commits when told: one per batch
        for s, v in batches(steps, per_commit, pace):
            for step, row in zip(s.tolist(), v.tolist()):
                store.put(Scalars(step, dict(zip(KEYS, row))))
            store.flush(timeout=600)
        store.close()

    def read(self, root: Path) -> pd.DataFrame:
        import nbwatch

        return nbwatch.open_run(root).df

    reader_code = "import nbwatch; print(nbwatch.open_run(sys.argv[1]).step)"


class ParquetSegments:
    name = "parquet segments"

    def write(self, root: Path, steps: int, per_commit: int, pace: float = 0.0) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        root.mkdir(parents=True)
        for i, (s, v) in enumerate(batches(steps, per_commit)):
            tmp = root / f".seg-{i:09d}.parquet"
            pq.write_table(pa.Table.from_pandas(frame_of(s, v), preserve_index=False), tmp)
            tmp.rename(root / f"seg-{i:09d}.parquet")  # readers see whole segments only

    def read(self, root: Path) -> pd.DataFrame:
        import pyarrow.dataset as ds

        return ds.dataset(sorted(map(str, root.glob("seg-*.parquet"))), format="parquet"
                          ).to_table().to_pandas().set_index("step")

    reader_code = textwrap.dedent("""
        import pathlib, pyarrow.dataset as ds
        files = sorted(map(str, pathlib.Path(sys.argv[1]).glob("seg-*.parquet")))
        print(ds.dataset(files, format="parquet").count_rows() if files else 0)""")


class DuckDB:
    name = "duckdb"

    def write(self, root: Path, steps: int, per_commit: int, pace: float = 0.0) -> None:
        import duckdb

        root.mkdir(parents=True)
        con = duckdb.connect(str(root / "run.duckdb"))
        cols = ", ".join(f'"{k}" {"FLOAT" if k in F32 else "DOUBLE"}' for k in KEYS)
        con.execute(f"CREATE TABLE s (step BIGINT, {cols})")
        for s, v in batches(steps, per_commit, pace):
            df = frame_of(s, v)  # noqa: F841 (read by name by DuckDB)
            con.execute("INSERT INTO s SELECT * FROM df")
        con.close()

    def read(self, root: Path) -> pd.DataFrame:
        import duckdb

        con = duckdb.connect(str(root / "run.duckdb"), read_only=True)
        try:
            return con.execute("SELECT * FROM s ORDER BY step").df().set_index("step")
        finally:
            con.close()

    reader_code = textwrap.dedent("""
        import duckdb
        con = duckdb.connect(sys.argv[1] + "/run.duckdb", read_only=True)
        print(con.execute("SELECT COUNT(*) FROM s").fetchone()[0])""")


def size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def concurrent(engine, root: Path, steps: int = 10_000) -> str:
    """Write `steps` in commits of 20, 100 commits a second at most, in this process while
    another process polls every 0.1 s: what it saw (polls answered, distinct step counts,
    the last count) and the errors it met."""
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            seen, errors = [], set()
            end = time.monotonic() + 60
            while time.monotonic() < end:
                try:
                    exec({engine.reader_code!r})
                except Exception as e:
                    errors.add(type(e).__name__ + ": " + str(e).splitlines()[0][:80])
                time.sleep(0.1)
                if __import__("pathlib").Path(sys.argv[1], "done").exists():
                    break
        """).replace("print(", "seen.append(")
         + "\nprint((len(seen), len(set(seen)), seen[-1] if seen else None), sorted(errors))",
         str(root)],
        stdout=subprocess.PIPE, text=True)
    time.sleep(3.0)  # the reader's imports
    engine.write(root, steps, 20, pace=0.01)
    (root / "done").touch()
    out, _ = reader.communicate(timeout=120)
    return out.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bulk", type=int, default=1_000_000)
    ap.add_argument("--live", type=int, default=100_000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="nbwatch-engines-"))
    try:
        for engine in (SQLiteBlocks(), ParquetSegments(), DuckDB()):
            for label, steps, per in (("bulk", args.bulk, 10_000), ("live", args.live, 20)):
                root = tmp / f"{engine.name.split()[0]}-{label}"
                t0 = time.perf_counter()
                engine.write(root, steps, per)
                w = time.perf_counter() - t0
                t0 = time.perf_counter()
                df = engine.read(root)
                r = time.perf_counter() - t0
                assert df.shape == (steps, len(KEYS)), df.shape
                n = steps * len(KEYS)
                print(f"{engine.name:24s} {label}: write {n / w / 1e6:5.2f}M scalars/s, "
                      f"{size(root) / n:5.2f} B/scalar, read {r:5.2f} s", flush=True)
                shutil.rmtree(root)
            root = tmp / f"{engine.name.split()[0]}-concurrent"
            seen = concurrent(engine, root)
            print(f"{engine.name:24s} a second process polling while it writes: "
                  f"(polls answered, distinct, last), errors = {seen}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
