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
# figures whose definition changed since the recording, compared in the folder's reads
# only: update ratios divide by ‖W‖ before the update (cs231n's ratio), the recording's
# by ‖W‖ after it
REDEFINED = ("update_ratio/",)


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(DATA / "golden_reads.npz") as f:
        return {k: f[k] for k in f.files}


def is_map(key: str) -> bool:
    return key.startswith("att") and key[-1].isdigit()


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray],
                varying: bool = False) -> None:
    """Equal, every array; with `varying` (a fresh run, maybe on another CPU, whose float
    rounding may differ): the clock's and the machine's columns of `df` aside, figures
    within 1e-3 relative, histograms the same counts in all (a value may cross a bin's
    edge), attention maps within 1/255 of the recorded ones."""
    assert sorted(got) == sorted(want)
    differ = []
    if varying:  # a figure added since (spike/score, ...) is new, every one recorded stays
        cols = list(got["df_columns"])
        missing = [c for c in want["df_columns"] if c not in cols]
        assert not missing, f"no longer recorded: {missing}"
        keep = [i for i, c in enumerate(want["df_columns"])
                if not c.startswith((*VARYING, *REDEFINED))]
        at = [cols.index(want["df_columns"][i]) for i in keep]
        got = {**got, "df_columns": want["df_columns"], "df_values": got["df_values"][:, at]}
        want = {**want, "df_values": want["df_values"][:, keep]}
    for k, w in want.items():
        g = got[k]
        if g.shape != w.shape or g.dtype != w.dtype:
            differ.append(f"{k}: {g.shape} {g.dtype} != {w.shape} {w.dtype}")
        elif varying and is_map(k):
            if not np.abs(g - w).max() <= 1 / 255 + 1e-6:
                differ.append(k)
        elif varying and k.endswith("_counts"):
            moved = np.abs(g.astype(np.int64) - w).sum(axis=1)
            if not (np.array_equal(g.sum(axis=1), w.sum(axis=1))
                    and (moved <= 0.02 * w.sum(axis=1)).all()):
                differ.append(k)
        elif varying and g.dtype.kind == "f":
            if not np.allclose(g, w, rtol=1e-3, atol=1e-6, equal_nan=True):
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
