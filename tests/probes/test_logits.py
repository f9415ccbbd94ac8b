"""`probes.logits`: the training batch's log Z and max |logit| over a fixed subsample of
positions, and the output layer's forward hook that takes them in a framework's fit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nbwatch.demo import TinyGPT
from nbwatch.probes.logit_rows import (
    LARGE_V,
    NAMES,
    POSITIONS,
    logit_parts,
    reduce_rows,
    row_figures,
)
from nbwatch.probes.logits import HeadWatch


def test_log_z_and_max_abs_over_at_most_64_positions_by_a_fixed_stride():
    g = torch.Generator().manual_seed(0)
    for batch, T in ((16, 128), (3, 7), (1, 1000)):
        logits = torch.randn(batch, T, 50, generator=g) * 3
        flat = logits.reshape(-1, 50)
        stride = math.ceil(flat.shape[0] / POSITIONS)
        rows = flat[::stride]
        assert len(rows) <= POSITIONS  # the cost does not grow with the batch
        lz, top = logit_parts(logits)
        assert lz.dim() == 0 and top.dim() == 0  # staged as device figures
        assert lz.item() == torch.logsumexp(rows, -1).mean().item()
        assert top.item() == rows.abs().max().item()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, or NaN both (an all -inf row times a 0 of the mask is NaN either way)."""
    return torch.equal(a, b) or bool(a.isnan() and b.isnan())


def test_a_large_vocabulary_gives_the_same_bits_as_logsumexp_and_abs_max():
    """From LARGE_V on the figures take one pass fewer over the rows: the same values, bit
    for bit, as torch.logsumexp and |x|.max(), non-finite logits included."""
    g = torch.Generator().manual_seed(1)
    for V in (LARGE_V, 5000):
        for scale, special in ((1e-3, None), (3.0, "inf"), (300.0, "-inf row"), (3.0, None)):
            logits = torch.randn(2, 40, V, generator=g) * scale
            if special == "inf":
                logits[0, 0, 7] = math.inf  # log Z and max |logit| inf
            elif special == "-inf row":
                logits[0, 0, :] = -math.inf  # its log Z -inf, what logsumexp says
            for mask in (None, (torch.rand(2, 40, generator=g) > 0.3).long()):
                rows = logits.reshape(-1, V)[:: math.ceil(80 / POSITIONS)]
                lz_rows, top_rows = torch.logsumexp(rows, -1), rows.abs().amax(-1)
                lz, top = logit_parts(logits, mask)
                if mask is None:
                    want = [lz_rows.mean(), top_rows.amax()]
                else:
                    m = mask.reshape(-1)[:: math.ceil(80 / POSITIONS)].float()
                    want = [(lz_rows * m).sum() / m.sum(), (top_rows * m).amax()]
                assert same(lz, want[0]) and same(top, want[1])
        nan = torch.randn(1, 3, V, generator=g)
        nan[0, 1, 5] = math.nan
        assert all(math.isnan(f.item()) for f in logit_parts(nan))  # a NaN is not hidden


@pytest.mark.parametrize("V", [2, 65, 1000, LARGE_V])
def test_the_lean_path_an_accelerator_takes_gives_the_same_bits_at_any_vocabulary(V):
    """On a GPU every vocabulary takes the lean path (fewer launches): the same bits as
    torch.logsumexp and |x|.max(), per row, an inf, a -inf row and a NaN row included."""
    from nbwatch.probes.logit_rows import log_z_and_top

    g = torch.Generator().manual_seed(V)
    rows = torch.randn(12, V, generator=g) * 5
    rows[1, 0] = math.inf
    rows[2, :] = -math.inf
    rows[3, -1] = -math.inf
    rows[4, 0] = math.nan
    lz, top = log_z_and_top(rows, lean=True)
    want_lz, want_top = torch.logsumexp(rows, -1), rows.abs().amax(-1)
    for i in range(len(rows)):
        assert same(lz[i], want_lz[i]) and same(top[i], want_top[i]), (i, lz[i], want_lz[i])


def test_a_mask_leaves_padding_out_and_a_half_precision_head_is_read_in_float():
    logits = torch.zeros(2, 4, 8, dtype=torch.bfloat16)
    logits[:, 2:] = 1000.0  # padding positions with wild logits (never trained on)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]])
    lz, top = logit_parts(logits, mask)
    assert lz.dtype == torch.float32
    assert lz.item() == torch.logsumexp(torch.zeros(8), 0).item() and top.item() == 0.0
    assert math.isnan(logit_parts(logits, torch.zeros(2, 4))[1].item())  # no real token
    # a mask of another shape (the labels were shifted): every position counts
    assert logit_parts(logits, torch.ones(2, 5))[1].item() == 1000.0


def test_a_mask_on_another_device_than_the_logits_weighs_them_there():
    """A start() step_fn that moves a CPU batch to the GPU itself (`model(**{k: v.cuda()
    ...}).loss`) leaves the batch's attention_mask, which weighs the output layer's rows,
    on the CPU: its rows are brought to the logits' device (a CPU mask and meta logits
    stand in for it here), not multiplied across devices, which failed the run's step 1."""
    rows = row_figures(torch.zeros(2, 4, 8, device="meta"))
    lz, top = reduce_rows(rows, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]]))
    assert lz.device.type == top.device.type == "meta" and lz.shape == top.shape == ()


def test_the_head_hook_keeps_the_first_training_forward_and_is_removed():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=1, heads=2, ctx=16)
    ids = torch.randint(0, 64, (2, 16))
    watch = HeadWatch(model)
    assert watch.path == "head" and len(model.head._forward_hooks) == 1
    assert watch.take() == ([], [])  # no forward yet
    model.eval()
    model(ids)  # an eval's forward, or nbwatch's probe pass: not the training batch
    model.train()
    with torch.no_grad():
        model(ids)
    assert watch.take() == ([], [])
    first = model(ids)
    model((ids + 1) % 64)  # a second micro-batch of the step
    names, parts = watch.take()
    assert names == NAMES
    assert [p.item() for p in parts] == [p.item() for p in logit_parts(first)]
    assert watch.take() == ([], [])  # taken once a step
    watch.remove()
    assert not model.head._forward_hooks


@pytest.mark.parametrize("gpu_order", [False, True])
def test_a_softcapping_models_log_z_is_that_of_its_capped_logits(tmp_path, monkeypatch,
                                                                  gpu_order):
    """Gemma 3 with `final_logit_softcapping=30` (its output layer scaled up, so that the
    raw logits pass 30): `train_logits/*` from the output layer's hook are those of
    `out.logits`, what its loss uses, not of the layer's raw output (126 against 30 before)."""
    pytest.importorskip("transformers")
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    import nbwatch
    from nbwatch.probes.logit_rows import logit_parts
    from nbwatch.recorder import host_copy

    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, final_logit_softcapping=30.0,
                           max_position_embeddings=64)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(400.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    expected = []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        for _ in range(4):
            ids = torch.randint(0, 256, (2, 32))
            mask = torch.ones(2, 32, dtype=torch.long)
            out = model(input_ids=ids, attention_mask=mask, labels=ids)
            expected.append([float(t) for t in logit_parts(out.logits.detach(), mask)])
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=out.loss, mask=mask)  # no logits=: the output layer's hook
    df = nbwatch.open_run(tmp_path / "r").df
    # from step 2: the hook is set at the first log()
    got = df[["train_logits/log_z", "train_logits/max_abs"]].to_numpy()[1:]
    np.testing.assert_allclose(got, np.array(expected)[1:], rtol=1e-5)
    assert (df["train_logits/max_abs"].dropna() <= 30.0 + 1e-4).all()


def test_one_output_logits_from_a_step_fn_are_said_not_blamed_on_compile(tmp_path):
    """A step_fn whose 'logits' have one entry on their last axis (a regression head) has no
    log Z to take: one probe event says so, and nothing blames torch.compile or a fused loss
    (the hook that would look for them is not set)."""
    import nbwatch
    from nbwatch.demo import make_demo

    demo = make_demo(d=32, layers=2, heads=2, ctx=32, max_steps=6)

    def step_fn(model, batch):
        out = demo.step_fn(model, batch)
        loss = nbwatch.masked_cross_entropy(out["logits"], out["labels"], out["mask"])
        return {"loss": loss, "logits": out["logits"][..., :1]}

    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    mon.start(step_fn, demo.train, max_steps=6, display=False).wait()
    said = mon.events.message
    assert said.str.contains("not \\[..., vocab\\] scores over two or more classes").sum() == 1
    assert not said.str.contains("torch.compile").any(), said.tolist()
    assert "train_logits/log_z" not in mon.df
