"""Attention maps in the store: exact in float16, causal maps as their lower triangle, and
every encoding written before still read."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from nbwatch.store.rows import pack_attention, unpack_attention


def softmax_maps(heads: int, t: int, s: int, causal: bool, seed: int = 0,
                 scale: float = 3.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((heads, t, s)) * scale
    if causal:
        x[:, np.triu(np.ones((t, s), dtype=bool), 1)] = -np.inf
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("shape,causal,encoding", [
    ((4, 64, 64), True, "f2pt+z"),      # a decoder's self-attention
    ((4, 64, 64), False, "f2p+z"),      # an encoder's
    ((2, 12, 30), False, "f2p+z"),      # cross-attention, T × S
    ((1, 1, 1), False, "f2p+z"),
])
def test_maps_come_back_exactly_as_float16(shape, causal, encoding):
    w = softmax_maps(*shape, causal=causal)
    enc, data = pack_attention(w)
    assert enc == encoding
    back = unpack_attention(enc, data, list(shape))
    assert back.dtype == np.float32 and back.shape == shape
    assert np.array_equal(back, w.astype(np.float16).astype(np.float32))


def test_a_causal_map_is_smaller_than_its_float16_bytes_packed():
    """A young model's heads attend broadly (logits of a small scale): their float16
    exponents repeat, which the high-byte plane turns into what zlib finds."""
    w = softmax_maps(4, 64, 64, causal=True, scale=0.05)
    _, data = pack_attention(w)
    assert len(data) < 0.85 * len(zlib.compress(w.astype(np.float16).tobytes(), 6))


def test_a_map_with_one_weight_above_the_diagonal_is_kept_whole():
    w = softmax_maps(2, 16, 16, causal=True)
    w[1, 3, 9] = 0.25
    enc, data = pack_attention(w)
    assert enc == "f2p+z"
    assert unpack_attention(enc, data, [2, 16, 16])[1, 3, 9] == 0.25


def test_earlier_encodings_still_read():
    w = softmax_maps(2, 8, 8, causal=True)
    f2 = w.astype(np.float16)
    assert np.array_equal(unpack_attention(None, f2.tobytes(), [2, 8, 8]), f2.astype(np.float32))
    assert np.array_equal(unpack_attention("f2+z", zlib.compress(f2.tobytes()), [2, 8, 8]),
                          f2.astype(np.float32))
    u1 = np.rint(w * 255).astype(np.uint8)
    got = unpack_attention("u1/255+z", zlib.compress(u1.tobytes()), [2, 8, 8])
    assert np.allclose(got, w, atol=1 / 510 + 1e-7)
