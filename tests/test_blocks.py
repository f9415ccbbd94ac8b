"""Scalar blocks' values on disk (`blocks.pack`/`unpack`): packed where it pays, plain
otherwise, and every value back bit for bit either way."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from nbwatch import blocks

DTYPES = ["f4", "f8"]


def training_like(n: int, k: int, dtype: str, seed: int = 0) -> np.ndarray:
    """A family that packs, as a real run's `loss`/`lr`/`tokens` ones do: a falling loss
    read from a float32 tensor, a constant LR, token counts, and (k > 3) an eval's
    figures every 100 steps, NaN between."""
    rng = np.random.default_rng(seed)
    v = np.full((n, k), np.nan)
    v[:, 0] = (2.5 * np.exp(-np.arange(n) / 500) + 1.0 + rng.normal(0, 0.02, n)
               ).astype(np.float32)
    v[:, 1 % k] = 3e-4
    v[:, 2 % k] = rng.integers(900, 1024, n)
    v[::100, 3:] = rng.normal(2, 0.1, (len(v[::100]), max(k - 3, 0)))
    return v.astype(dtype)


def noisy(n: int, k: int, dtype: str, seed: int = 0) -> np.ndarray:
    """A family that stays plain: per-layer gradient norms, each a slow random walk."""
    rng = np.random.default_rng(seed)
    return np.exp(np.cumsum(rng.normal(0, 0.01, (n, k)), axis=0)).astype(dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == np.ascontiguousarray(
        b).tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_training_series_is_packed_smaller_and_reads_back_bit_for_bit(dtype):
    v = training_like(2000, 12, dtype)
    data = blocks.pack(v)
    assert len(data) % v.itemsize  # the packed form
    assert len(data) <= 0.5 * v.nbytes
    assert same_bits(blocks.unpack(data, dtype, 12), v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_noisy_family_stays_plain_where_unpacking_would_cost_more_than_it_saves(dtype):
    v = noisy(2000, 12, dtype)
    assert 0.5 * v.nbytes < len(zlib.compress(np.ascontiguousarray(v.T).tobytes(),
                                              blocks.ZLIB_LEVEL)) < v.nbytes
    data = blocks.pack(v)
    assert data == v.tobytes()
    assert same_bits(blocks.unpack(data, dtype, 12), v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_that_do_not_compress_stay_plain(dtype):
    rng = np.random.default_rng(1)
    width = 7
    noise = np.frombuffer(rng.bytes(300 * width * np.dtype(dtype).itemsize), dtype=dtype)
    noise = noise.reshape(300, width)
    data = blocks.pack(noise)
    assert data == noise.tobytes()  # what schema 3 wrote: the values as they lie
    assert same_bits(blocks.unpack(data, dtype, width), noise)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_keep_their_bits(dtype):
    v = training_like(500, 5, dtype)
    v[:, 4] = 1.0
    tiny = np.finfo(dtype).smallest_subnormal
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, tiny, -tiny],
                       dtype=dtype)
    v[::37, 3] = np.resize(special, len(v[::37, 3]))
    payload = 0x7FC00001 if dtype == "f4" else 0x7FF8000000000001  # a NaN with a payload
    v[5:6, 4].view(f"u{v.itemsize}")[:] = payload
    data = blocks.pack(v)
    assert len(data) % v.itemsize
    assert same_bits(blocks.unpack(data, dtype, 5), v)


def test_a_packed_blob_is_never_a_multiple_of_the_item_size():
    """Plain and packed blobs are told apart by their length alone: check it over many
    shapes and contents, each of which zlib packs to another length."""
    rng = np.random.default_rng(2)
    packed = padded = 0
    for n in range(40, 400, 7):
        for k in (1, 2, 3, 8):
            for dtype in DTYPES:
                v = np.round(rng.normal(1, 0.01, (n, k)), 1 + n % 2).astype(dtype)
                data = blocks.pack(v)
                if len(data) != v.nbytes:
                    packed += 1
                    assert len(data) % v.itemsize
                    z = zlib.compress(np.ascontiguousarray(v.T).tobytes(), blocks.ZLIB_LEVEL)
                    padded += len(z) % v.itemsize == 0
                assert same_bits(blocks.unpack(data, dtype, k), v)
    assert packed > 200 and padded > 10  # both forms of a packed blob were made


def test_encode_and_decode_a_block_of_steps_with_gaps():
    steps = np.array([1, 2, 3, 7, 8, 20], dtype=np.int64)
    v = training_like(6, 4, "f4")
    (first, last, st, data), = blocks.encode(steps, v, "f4")
    assert (first, last) == (1, 20) and st is not None
    lay = blocks.Layout(1, ("a", "b", "c", "d"), "f4")
    s, got = blocks.decode(first, st, data, lay)
    assert s.tolist() == steps.tolist() and same_bits(got, v)
    assert blocks.rows_held(first, last, st) == 6
    assert blocks.rows_held(1, 500, None) == 500


def test_walls_stay_plain_when_asked():
    steps = np.arange(1, 1001, dtype=np.int64)
    walls = (1.8e9 + steps * 0.05)[:, None]
    (_, _, _, data), = blocks.encode(steps, walls, "f8", packed=False)
    assert data == walls.tobytes()
