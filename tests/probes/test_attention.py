import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nbwatch.demo import TinyGPT
from nbwatch.probes.attention import capture_attention, sdpa_weights, take_samples


def test_sdpa_model_maps_equal_an_explicit_softmax():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32).eval()
    idx = torch.randint(1, 64, (3, 10))
    with capture_attention(model, samples=2, max_tokens=8) as maps:
        model(idx)
    assert sorted(maps) == ["blocks.0.attn", "blocks.1.attn"]
    w = maps["blocks.0.attn"]
    assert w.shape == (2, 2, 8, 8)  # samples, heads, T, S (cropped)
    # recompute block 0's q, k by hand
    blk = model.blocks[0]
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(10))
    q, k, _ = blk.attn.qkv(blk.ln1(x)).split(32, dim=2)
    q = q.view(3, 10, 2, 16).transpose(1, 2)
    k = k.view(3, 10, 2, 16).transpose(1, 2)
    causal = torch.full((10, 10), float("-inf")).triu(1)
    ref = torch.softmax((q @ k.transpose(-2, -1)) / 4.0 + causal, -1)
    assert torch.allclose(w, ref[:2, :, :8, :8], atol=1e-5)
    assert torch.allclose(w.sum(-1), torch.ones(2, 2, 8), atol=1e-5)  # causal rows sum to 1


def test_sdpa_weights_match_sdpa_output():
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    mask = torch.rand(5, 5) > 0.3
    mask.fill_diagonal_(True)
    w = sdpa_weights(q, k, attn_mask=mask)
    assert torch.allclose(w @ v, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-5)
    w = sdpa_weights(q, k, is_causal=True, scale=0.3)
    assert torch.allclose(w @ v, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
                          atol=1e-5)


def test_multihead_attention_per_head_weights_even_when_the_caller_asks_for_none():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 6, 16)
    _, expected = mha(x, x, x, need_weights=True, average_attn_weights=False)
    model = nn.Sequential()
    model.add_module("attn", mha)

    class Caller(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    caller = Caller()
    with capture_attention(caller) as maps:
        caller(x)
    assert list(maps) == ["mha"]
    assert torch.allclose(maps["mha"], expected, atol=1e-6)
    assert not mha._forward_hooks and not mha._forward_pre_hooks


def test_transformer_encoder_in_eval_mode_is_captured_despite_the_fast_path():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), num_layers=2,
        enable_nested_tensor=False,
    ).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        plain = enc(x)
    with capture_attention(enc) as maps:
        out = enc(x)
    assert sorted(maps) == ["layers.0.self_attn", "layers.1.self_attn"]
    assert maps["layers.0.self_attn"].shape == (2, 2, 5, 5)
    assert torch.allclose(out, plain, atol=1e-5)  # capturing does not change the output
    assert torch.backends.mha.get_fastpath_enabled()  # restored


def test_hooks_removed_even_when_forward_raises():
    model = TinyGPT(vocab=64, d=32, layers=1, heads=2, ctx=32)
    with pytest.raises(RuntimeError, match="the probe's forward failed"), \
            capture_attention(model):
        model(torch.zeros(1, 8, dtype=torch.long))
        raise RuntimeError("the probe's forward failed")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_take_samples_slices_every_tensor_of_a_batch():
    batch = {"x": torch.arange(10).view(5, 2), "meta": "keep", "pair": (torch.zeros(5), 3)}
    out = take_samples(batch, 2)
    assert out["x"].shape == (2, 2) and out["meta"] == "keep"
    assert out["pair"][0].shape == (2,) and out["pair"][1] == 3
