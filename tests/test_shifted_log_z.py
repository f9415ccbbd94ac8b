"""Labels shifted by hand: the loss compares logits[:, :-1] with labels[:, 1:], so the mask
that weighs it is a position shorter than the model's logits (`mask[:, 1:]`), or the
batch's attention_mask is a position longer than the logits handed over
(`logits[:, :-1]`). `train_logits/*` are weighed by that mask aligned as the loss is (the
logits at position t predict token t + 1): they were over every position, padding
included, wherever the two lengths differed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.probes.logit_rows import LOG_Z, MAX_ABS
from tests.conftest import lightning_fit


def batches() -> list[dict[str, torch.Tensor]]:
    """Two rows of 8, 8 and 5 tokens real (right padding): the shifted labels' real
    positions are 7 and 4 (the logits at t predict token t + 1)."""
    g = torch.Generator().manual_seed(0)
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, 5:] = 0
    return [{"input_ids": torch.randint(0, 64, (2, 8), generator=g), "attention_mask": am}
            for _ in range(3)]


def by_hand(logits: torch.Tensor, am: torch.Tensor) -> list[float]:
    """log Z and max |logit| over the positions t < T - 1 whose next token is real: 11 of
    the 16 (the rows are fewer than the 64 a step looks at: every one taken)."""
    x = logits.detach()[:, :-1].double()
    real = am[:, 1:].bool()
    return [float(x.logsumexp(-1)[real].mean()), float(x.abs().amax(-1)[real].max())]


def shifted_loss(logits: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return nbwatch.masked_cross_entropy(logits[:, :-1], b["input_ids"][:, 1:],
                                        b["attention_mask"][:, 1:])


def model_opt():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=16, layers=1, heads=2, ctx=32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def figures(df) -> np.ndarray:
    return df[[LOG_Z, MAX_ABS]].to_numpy()


def test_start_weighs_the_heads_logits_by_a_step_mask_a_position_shorter(tmp_path):
    """A step returning its loss and the shifted labels' mask (T - 1) while the output
    layer's hook takes the model's logits (T)."""
    model, opt = model_opt()
    want = []

    def step_fn(model, b):
        logits = model(b["input_ids"])
        want.append(by_hand(logits, b["attention_mask"]))
        return {"loss": shifted_loss(logits, b), "mask": b["attention_mask"][:, 1:]}

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    mon.start(step_fn, batches(), max_steps=3)
    mon.wait()
    assert mon.state == "finished", mon.error
    # the hook is set once step 1 handed no logits: from step 2
    np.testing.assert_allclose(figures(mon.df)[1:], np.array(want[1:]), rtol=1e-5)


@pytest.mark.parametrize("given", ["full logits, shifted mask", "shifted logits, batch"])
def test_an_own_loop_weighs_logits_and_a_mask_one_position_apart(tmp_path, given):
    """`log(logits=logits, mask=am[:, 1:])` (the mask a position shorter), or
    `log(logits=logits[:, :-1], batch=batch)` (the batch's attention_mask a position
    longer): the positions the loss weighs."""
    model, opt = model_opt()
    want = []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        for b in batches():
            logits = model(b["input_ids"])
            loss = shifted_loss(logits, b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            want.append(by_hand(logits, b["attention_mask"]))
            if given.startswith("full"):
                mon.log(loss=loss, logits=logits, mask=b["attention_mask"][:, 1:])
            else:
                mon.log(loss=loss, logits=logits[:, :-1], batch=b)
    np.testing.assert_allclose(figures(nbwatch.open_run(tmp_path / "r").df), np.array(want),
                               rtol=1e-5)


def test_lightning_weighs_the_heads_logits_by_a_batch_mask_a_position_shorter(tmp_path):
    """A Lightning batch's `mask` of the shifted labels (T - 1) beside the model's logits."""
    model, _ = model_opt()
    want = []

    def loss_of(net, b):
        logits = net(b["input_ids"])
        want.append(by_hand(logits, b["attention_mask"]))
        return shifted_loss(logits, b)

    data = [{"input_ids": b["input_ids"], "mask": b["attention_mask"][:, 1:],
             "attention_mask": b["attention_mask"]} for b in batches()]
    for b in data:  # Lightning reads `mask` (its first key found) where both are given
        del b["attention_mask"]

    def loss_of_mask(net, b):
        am = torch.cat([torch.ones_like(b["mask"][:, :1]), b["mask"]], 1)
        return loss_of(net, {"input_ids": b["input_ids"], "attention_mask": am})

    lightning_fit(tmp_path, model, loss_of_mask, data, tmp_path / "pl")
    df = nbwatch.open_run(tmp_path / "pl").df
    np.testing.assert_allclose(figures(df), np.array(want), rtol=1e-5)


def test_a_devices_figures_weigh_a_mask_one_position_apart_as_the_hosts():
    """On an accelerator the figures are reduced at the step (`logit_parts`), not from the
    host's copy of the rows: the same weighing; a mask two positions apart weighs none."""
    from nbwatch.probes.logit_rows import logit_parts

    torch.manual_seed(0)
    logits = torch.randn(2, 8, 64)
    am = batches()[0]["attention_mask"]
    want = by_hand(logits, am)
    for x, m in ((logits, am[:, 1:]), (logits[:, :-1], am)):
        assert [float(p) for p in logit_parts(x, m)] == pytest.approx(want, rel=1e-6)
    unweighted = [float(logits.logsumexp(-1).mean()), float(logits.abs().max())]
    assert [float(p) for p in logit_parts(logits, am[:, 2:])] == pytest.approx(unweighted,
                                                                                rel=1e-6)


def test_an_encoder_decoders_logits_are_never_weighed_by_its_sources_mask(tmp_path):
    """Lightning, a T5 batch that names no target mask (`decoder_input_ids`, no labels nor
    `decoder_attention_mask`): log Z over every target position, not weighed by the
    source's attention_mask, which it was where the two lengths matched (or, since a
    mask a position apart is aligned, were one apart)."""
    tf = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, 3:] = 0
    data = [{"input_ids": torch.randint(2, 64, (2, 8), generator=g), "attention_mask": am,
             "decoder_input_ids": torch.randint(2, 64, (2, t), generator=g)}
            for t in (8, 7, 9)]  # as long as the source, one shorter, one longer
    want = []

    def loss_of(net, b):
        logits = net(**b).logits
        x = logits.detach().double()
        want.append([float(x.logsumexp(-1).mean()), float(x.abs().max())])
        return logits.float().logsumexp(-1).mean()

    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(tf.T5Config(
        d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=8, vocab_size=64,
        decoder_start_token_id=0, pad_token_id=0))
    lightning_fit(tmp_path, model, loss_of, data, tmp_path / "pl")
    np.testing.assert_allclose(figures(nbwatch.open_run(tmp_path / "pl").df), np.array(want),
                               rtol=1e-5)
