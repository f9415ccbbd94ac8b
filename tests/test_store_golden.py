"""The golden comparison: what the public readers return for a seeded tiny run stays what
they returned when `tests/data/golden_reads.npz` was recorded (`tests/store_golden.py`),
for the run folder written then (an older store layout) and for a fresh run of the seed."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from nbwatch.store import RunStore

from .store_golden import VARYING, reads, train

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(DATA / "golden_reads.npz") as f:
        return {k: f[k] for k in f.files}


def is_map(key: str) -> bool:
    return key.startswith("att") and key[-1].isdigit()


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray],
                varying: bool = False) -> None:
    """Equal, every array; with `varying`, the clock's and the machine's columns of `df`
    aside, and attention maps written by this version in steps of 1/255 (`rows.py`):
    what the attention panel shows (×255, rounded) equal, the values within 1/510."""
    assert sorted(got) == sorted(want)
    differ = []
    for k, w in want.items():
        g = got[k]
        if k == "df_values" and varying:
            keep = [i for i, c in enumerate(want["df_columns"]) if not c.startswith(VARYING)]
            g, w = g[:, keep], w[:, keep]
        if g.shape != w.shape or g.dtype != w.dtype:
            differ.append(f"{k}: {g.shape} {g.dtype} != {w.shape} {w.dtype}")
        elif varying and is_map(k):
            if not (np.array_equal(np.rint(g * 255), np.rint(w * 255))
                    and np.abs(g - w).max() <= 1 / 510 + 1e-6):
                differ.append(k)
        elif not np.array_equal(g, w, equal_nan=g.dtype.kind == "f"):
            differ.append(k)
    assert not differ, differ


def test_the_golden_folder_reads_as_recorded(tmp_path, golden):
    run_dir = tmp_path / "golden_run"
    shutil.copytree(DATA / "golden_run", run_dir)
    assert_same(reads(run_dir), golden)


def test_the_golden_folder_reads_the_same_once_a_writer_reopened_it(tmp_path, golden):
    run_dir = tmp_path / "golden_run"
    shutil.copytree(DATA / "golden_run", run_dir)
    RunStore(run_dir).close()  # a resume opens the folder for writing
    assert_same(reads(run_dir), golden)


def test_a_fresh_run_of_the_seed_reads_as_recorded(tmp_path, golden):
    train(tmp_path / "run")
    assert_same(reads(tmp_path / "run"), golden, varying=True)
