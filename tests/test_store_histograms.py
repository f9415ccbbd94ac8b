"""Histograms as blocks (nbwatch/store/histograms.py): exact edges and counts back, in the
fewest bytes; truncate; a follower reads each histogram once."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from nbwatch.probes.weights import histogram
from nbwatch.records import Histogram, Scalars
from nbwatch.store import RunReader, RunStore
from nbwatch.store.histograms import decode_counts, decode_edges, encode_counts, encode_edges


def probe_edges(n: int, bins: int = 64) -> np.ndarray:
    g = torch.Generator().manual_seed(n)
    return np.stack([histogram(torch.randn(100, generator=g) * (i + 1), bins)[0].double().numpy()
                     for i in range(n)])[None]


@pytest.mark.parametrize("edges, kind", [
    (probe_edges(3), "range"),  # the probes' equal-width bins: the range alone
    (np.sort(np.random.default_rng(0).standard_normal((2, 3, 9))).astype(np.float32)
     .astype(np.float64), "f4"),
    (np.linspace(-1, 1, 8)[None, None], "f8"),  # not float32 values: kept as given
])
def test_edges_come_back_exactly_in_the_most_compact_kind(edges, kind):
    got_kind, data = encode_edges(edges)
    assert got_kind == kind
    back = decode_edges(got_kind, data, edges.shape[:2], edges.shape[-1] - 1)
    assert back.dtype == np.float64 and np.array_equal(back, edges)
    if kind == "range":
        assert len(data) == edges.shape[0] * edges.shape[1] * 8


@pytest.mark.parametrize("top, dtype", [(255, "u1"), (65535, "u2"), (1 << 31, "u4"),
                                        (1 << 40, "i8")])
def test_counts_take_the_smallest_integer_type_that_holds_them(top, dtype):
    c = np.random.default_rng(0).integers(0, top, (2, 3, 64), endpoint=True)
    c[0, 0, 0] = top
    got, data = encode_counts(c)
    assert got.removesuffix("+z").removesuffix("p") == dtype
    assert np.array_equal(decode_counts(got, data, c.shape), c)
    neg = c.copy()
    neg[0, 0, 1] = -1
    got, data = encode_counts(neg)
    assert got.startswith("i8") and np.array_equal(decode_counts(got, data, c.shape), neg)


def test_counts_of_a_real_histogram_pack_as_byte_planes_and_read_back():
    """Weight histograms over steps (bins of a normal tensor, counts of thousands): byte
    planes, far smaller than zlib on the counts as they lie; the old form still reads."""
    rng = np.random.default_rng(0)
    p = np.diff(np.linspace(-3, 3, 65) ** 3 / 27 + np.linspace(-3, 3, 65)) ** 2
    c = rng.multinomial(200_000, p / p.sum(), size=(20, 6))  # [steps, layers, bins]
    got, data = encode_counts(c)
    assert got == "u4p+z" if c.max() >= 65536 else got == "u2p+z"
    assert np.array_equal(decode_counts(got, data, c.shape), c)
    dtype = got.removesuffix("p+z")
    old = zlib.compress(c.astype(dtype).tobytes(), 6)
    assert len(data) < 0.9 * len(old)
    assert np.array_equal(decode_counts(dtype + "+z", old, c.shape), c)


@pytest.fixture
def store(tmp_path):
    s = RunStore(tmp_path / "run")
    yield s
    s.close()


def test_histograms_of_a_run_read_back_exactly_truncate_and_follow(store):
    rng = np.random.default_rng(0)
    put = []
    for step in (1, 5, 10, 15):
        store.put(Scalars(step, {"loss/train": 1.0}))
        for name, bins in (("weight/a", 8), ("weight/b", 8), ("data/seq_len", 4)):
            e = histogram(torch.from_numpy(rng.standard_normal(50)), bins)[0].double().numpy()
            c = rng.integers(0, 300, bins)
            store.put(Histogram(step, name, e, c))
            put.append((step, name, e, c))
        if step == 5:
            store.flush()
    store.flush()
    r = RunReader(store.run_dir)
    assert r.histogram_names() == ["weight/a", "weight/b", "data/seq_len"]
    seen = r.histograms_since(0, 1)  # one block: its histograms, all
    rest = r.histograms_since(seen[-1][0], 100)
    # each once; a commit's blocks go layout by layout, each layout's steps in order
    assert sorted((s, n) for _, s, n, _, _ in seen + rest) == sorted(
        (s, n) for s, n, _, _ in put)
    for name in ("weight/a", "data/seq_len"):
        steps, edges, counts = r.histograms(name)
        want = [p for p in put if p[1] == name]
        assert steps.tolist() == [p[0] for p in want]
        for e, c, p in zip(edges, counts, want):
            assert np.array_equal(e, p[2]) and np.array_equal(c, p[3])
    store.truncate_after(10)  # inside the second block
    store.flush()
    assert r.histograms("weight/b")[0].tolist() == [1, 5, 10]
    last = rest[-1][0]
    store.put(Histogram(12, "weight/a", put[0][2], put[0][3]))
    store.flush()
    assert [(s, n) for _, s, n, _, _ in r.histograms_since(last, 100)] == [(12, "weight/a")]
