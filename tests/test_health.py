"""Transformer health on the probe pass: attention entropy and max logit per head (SDPA,
Hugging Face eager attention, nn.MultiheadAttention), the residual stream's RMS per block,
the output log-partition; and the rules that watch them, on a healthy run and on a run
whose LR grows until the loss diverges."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import nbwatch
from nbwatch.alerts import health
from nbwatch.demo import TinyGPT, make_demo
from nbwatch.probes.activations import blocks, capture_block_rms, logit_figures
from nbwatch.probes.attention import capture_attention


def entropy_and_max(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per head, straight from the logits [B, H, T, S] (masked at −inf)."""
    p = torch.softmax(logits, -1)
    ent = -(p * torch.log(p.clamp_min(1e-12))).sum(-1).mean(dim=(0, 2))
    m = logits.masked_fill(torch.isinf(logits), -1e9).amax(dim=(0, 2, 3))
    return ent.numpy(), m.numpy()


def test_sdpa_entropy_and_max_logit_equal_a_direct_computation():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32).eval()
    idx = torch.randint(1, 64, (3, 10))
    with capture_attention(model, samples=2, max_tokens=8) as maps, \
            capture_block_rms(model, samples=2) as rms:
        out = model(idx)
    blk = model.blocks[0]
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(10))
    q, k, _ = blk.attn.qkv(blk.ln1(x)).split(32, dim=2)
    q, k = (t.view(3, 10, 2, 16).transpose(1, 2)[:2] for t in (q, k))
    logits = (q @ k.transpose(-2, -1)) / 4.0 + torch.full((10, 10), float("-inf")).triu(1)
    ent, mx = entropy_and_max(logits.detach())
    # uncropped: the 10 × 10 maps, though the stored maps are cropped to 8 × 8
    np.testing.assert_allclose(maps.entropy["blocks.0.attn"], ent, rtol=1e-5)
    np.testing.assert_allclose(maps.max_logit["blocks.0.attn"], mx, rtol=1e-5)
    h0 = model.blocks[0](x)[:2]
    assert rms["blocks.0"] == pytest.approx(float(h0.detach().pow(2).mean().sqrt()), rel=1e-5)
    assert list(rms) == ["blocks.0", "blocks.1"]
    f = logit_figures(out)
    assert f["logits/z_mean"] == pytest.approx(float(torch.logsumexp(out, -1).mean()), rel=1e-6)
    assert f["logits/max_abs"] == pytest.approx(float(out.abs().max()))
    # the scalar names the store and the rules read: per head, and per module
    figs = health.figures(maps.entropy, maps.max_logit, rms, f)
    assert figs["attn/max_logit/blocks.0.attn"] == pytest.approx(float(mx.max()), rel=1e-5)
    assert figs["attn/entropy/blocks.0.attn/1"] == pytest.approx(float(ent[1]), rel=1e-5)
    assert health.per_head("attn/entropy/blocks.0.attn/1")
    assert not health.per_head("attn/entropy/blocks.0.attn")


def test_hf_eager_attention_logits_come_from_its_softmax():
    """Eager attention computes softmax(QKᵀ/√d + mask) in Python: the probe reads the
    logits at that softmax, padding and the causal mask excluded."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(
        n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=32,
        attn_implementation="eager")).eval()
    ids = torch.randint(1, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0  # padding at the end of sample 1
    model.config.output_attentions = True
    with capture_attention(model, samples=2) as maps:
        out = model(input_ids=ids, attention_mask=mask)
    attn = model.transformer.h[0].attn
    x = model.transformer.wte(ids) + model.transformer.wpe(torch.arange(12))
    q, k, _ = attn.c_attn(model.transformer.h[0].ln_1(x)).split(32, dim=2)
    q, k = (t.view(2, 12, 4, 8).transpose(1, 2) for t in (q, k))
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    allowed = torch.ones(12, 12, dtype=torch.bool).tril() & mask[:, None, None, :].bool()
    logits = logits.masked_fill(~allowed, float("-inf")).detach()
    _, mx = entropy_and_max(logits)
    np.testing.assert_allclose(maps.max_logit["transformer.h.0.attn"], mx, rtol=1e-4)
    # every query row attends (a padded query still sees the real keys before it)
    w = out.attentions[0]
    want = -(w * torch.log(w.clamp_min(1e-12))).sum(-1).mean(dim=(0, 2))
    np.testing.assert_allclose(maps.entropy["transformer.h.0.attn"], want.detach().numpy(),
                               rtol=1e-4)


def test_multihead_attention_logits_per_head():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 6, 16)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x)[0]

    model = Wrap()
    with capture_attention(model, samples=2) as maps:
        model(x)
    wq, wk, _ = mha.in_proj_weight.split(16)
    bq, bk, _ = mha.in_proj_bias.split(16)
    q = (x @ wq.T + bq).view(2, 6, 4, 4).transpose(1, 2)
    k = (x @ wk.T + bk).view(2, 6, 4, 4).transpose(1, 2)
    ent, mx = entropy_and_max(((q @ k.transpose(-2, -1)) / 2.0).detach())
    np.testing.assert_allclose(maps.max_logit["mha"], mx, rtol=1e-4)
    np.testing.assert_allclose(maps.entropy["mha"], ent, rtol=1e-4)
    assert blocks(model) == []  # no repeated blocks: no activation figures


def health_alerts(mon) -> list[tuple[int, str]]:
    ev = mon.events
    names = {r.name for r in health.rules()}
    rows = ev[(ev.kind == "alert")]
    return [(int(s), m) for s, m in zip(rows.step, rows.message) if m.split(":")[0] in names]


def test_a_healthy_run_stays_quiet(tmp_path):
    demo = make_demo(d=64, layers=2, heads=4, ctx=64, max_steps=300)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    mon.start(max_steps=300, eval_every=20, display=False, **demo.start_kwargs()).wait()
    assert mon.state == "finished"
    df = mon.df
    assert df["attn/max_logit/blocks.0.attn"].notna().sum() == 15  # every probe recorded
    assert df["act/rms/blocks.1"].notna().sum() == 15
    assert health_alerts(mon) == []


def test_growing_lr_trips_logit_growth_and_entropy_collapse_before_the_loss_diverges(tmp_path):
    """The LR grows 4% a step (an LR range test run past its edge; no QK-norm): attention
    logits grow and heads collapse onto one token long before the loss blows up."""
    torch.manual_seed(0)
    demo = make_demo(d=64, layers=2, heads=4, ctx=64, lr=1e-3, warmup=1, max_steps=200)
    sched = torch.optim.lr_scheduler.LambdaLR(demo.optimizer, lambda s: 1.04 ** s)
    quiet = {r: {"actions": []} for r in ("nonfinite", "grad_explosion", "val_spike")}
    mon = nbwatch.Monitor(demo.model, demo.optimizer, sched, run_dir=tmp_path / "r",
                          alerts=quiet)
    mon.start(max_steps=200, eval_every=5, display=False, **demo.start_kwargs()).wait()
    loss = mon.df["loss/train"]
    best = loss.rolling(5).mean().min()
    diverged = int(loss[loss > 2 * best].index.min())  # the loss doubles its best
    fired = {m.split(":")[0]: s for s, m in reversed(health_alerts(mon))}
    assert fired["attention_logit_growth"] < diverged - 30, (fired, diverged)
    assert fired["attention_entropy_collapse"] < diverged - 30, (fired, diverged)
    print(f"logit growth at step {fired['attention_logit_growth']}, entropy collapse at "
          f"{fired['attention_entropy_collapse']}, loss doubled its best at {diverged}")


def test_logz_drift_fires_once_on_a_rise_and_not_on_a_slow_drift_or_one_noisy_batch():
    """The training batch's log Z every step: a healthy run's slow climb (+1.5 nats over
    500 steps) and its batch-to-batch noise are no news, nor is one wild batch (the median
    of the last 5 steps); a rise of 3 nats over 10 steps fires, once for the episode."""
    from nbwatch.alerts import AlertEngine, default_rules

    rng = np.random.default_rng(0)
    eng = AlertEngine([r for r in default_rules() if r.name == "logz_drift"])
    z = 4.8 + np.linspace(0, 1.5, 500) + 0.3 * rng.standard_normal(500)
    z[300] += 6.0  # one batch
    z = np.concatenate([z, z[-1] + np.linspace(0, 3, 10) + 0.3 * rng.standard_normal(10),
                        np.full(30, z[-1] + 3.0)])
    fired = [a for step, v in enumerate(z.tolist(), 1)
             for a in eng.observe("step", step, {"train_logits/log_z": v})]
    assert len(fired) == 1 and 500 < fired[0].step <= 510, [a.step for a in fired]
    a = fired[0]
    assert a.data["rise"] > 1.0 and a.data["z"] > 4 and "z-loss" in a.message


# The largest attention logit of the demo's third block at each probe of `nbwatch demo`
# (600 steps, a probe every 50; recorded 2026-12-04), and of an LR run past its edge
# (the test above, a probe every 5 steps, from step 60).
DEMO = [9.7, 29.8, 43.5, 51.4, 46.6, 41.6, 41.3, 41.6, 36.8, 36.3, 36.9, 36.3]
RAMP = [14.6, 15.5, 17.6, 21.7, 25.9, 28.8, 32.9, 34.1, 45.0, 45.8, 59.8, 83.0, 102.9]
# A healthy 12 × 12 Hugging Face GPT-2 (d=192, eager attention, AdamW 3e-3, 30 warm-up
# steps then cosine, 300 steps on the demo's data, a probe every 25; loss 3.19 → 2.53;
# recorded 2026-12-05): its blocks' logits climb 3-4× over 4 probes, each climb slowing.
HEALTHY_12X12 = {
    "h.1": [2.9, 10.6, 12.2, 11.6, 22.0, 32.3, 39.7, 40.4, 42.6, 44.2, 44.7, 44.8],
    "h.2": [2.4, 14.5, 21.3, 19.2, 25.3, 34.2, 37.2, 42.6, 47.3, 46.3, 46.8, 46.5],
    "h.4": [0.4, 14.0, 13.2, 21.0, 29.5, 45.4, 45.5, 47.0, 51.8, 54.2, 51.8, 51.8],
}


def logit_growth_alerts(series: list[float], every: int) -> list[int]:
    from nbwatch.alerts import AlertEngine

    engine = AlertEngine([r for r in health.rules() if r.name == "attention_logit_growth"])
    fired = []
    for i, v in enumerate(series, 1):
        if engine.observe("eval", i * every, {"attn/max_logit/blocks.2.attn": v}):
            fired.append(i * every)
    return fired


def test_logit_growth_is_quiet_on_the_demo_and_fires_on_a_sustained_rise():
    """The demo's logits grow from their initial scale and settle (they passed 50 once,
    which the rule's level of 50 took for a divergence); a run whose logits double over 4
    rising probes is warned."""
    assert logit_growth_alerts(DEMO, 50) == []
    assert logit_growth_alerts(RAMP, 5) == [60]  # its 12th probe: 83.0, 2.4× in 4 probes


def test_logit_growth_is_quiet_on_a_healthy_run_whose_logits_climb_and_slow_down():
    """A healthy 12 × 12 GPT-2's logits double (and more) over 4 rising probes early on,
    but each rise is smaller than the one before: the rule waits for a growth that does
    not slow (the ramp's last probes rose faster than its first)."""
    for block, series in HEALTHY_12X12.items():
        assert logit_growth_alerts(series, 25) == [], block
