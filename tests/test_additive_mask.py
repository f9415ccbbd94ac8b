"""A float additive attention mask (0.0 where a token is attended, -inf or torch.finfo.min
where it is masked, as some users build them) is read as the 0/1 mask it stands for in
every loop: its 0.0s are the real tokens. It was read upside down: the padding counted as
the tokens (`mask != 0`), a mask given to `log(mask=...)` or returned by a step refused as
one "of other values than 0 and 1". A 0/1 float mask reads as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.probes.logit_rows import logit_parts
from tests.conftest import lightning_fit

FILLS = {"-inf": float("-inf"), "finfo.min": torch.finfo(torch.float32).min, "0/1": None}


def masks(fill: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 8, 8 and 5 tokens real (13 of 16): the mask in the form `fill` names
    (additive, or 0/1 where None), and the 0/1 mask it stands for."""
    real = torch.ones(2, 8)
    real[1, 5:] = 0
    if fill is None:
        return real, real
    return torch.zeros(2, 8).masked_fill(real == 0, fill), real


def batches(fill: float | None, key: str = "attention_mask") -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 60, (2, 8), generator=g), key: masks(fill)[0]}
            for _ in range(3)]


def loss_of(model, b):
    ids = b["input_ids"]
    return torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1),
                                             ids[:, 1:].flatten())


def model_opt():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=16, layers=1, heads=2, ctx=32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def check(df, name: str) -> None:
    """The rows' 13 real tokens of 16, their lengths 8 and 5."""
    n = len(df)
    assert df["tokens/real"].tolist() == [13.0] * n, name
    assert df["data/padding_ratio"].tolist() == pytest.approx([3 / 16] * n), name
    assert df["data/seq_len_mean"].tolist() == pytest.approx([6.5] * n), name
    assert df["data/seq_len_max"].tolist() == [8.0] * n, name


@pytest.mark.parametrize("fill", FILLS.values(), ids=FILLS.keys())
def test_an_additive_attention_mask_counts_its_zeros_as_the_tokens_in_every_loop(tmp_path, fill):
    dfs = {}
    model, opt = model_opt()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "start", display=False)
    mon.start(loss_of, batches(fill), max_steps=3)
    mon.wait()
    assert mon.state == "finished", mon.error
    dfs["start"] = mon.df

    for how in ("batch", "mask"):
        model, opt = model_opt()
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / how, display=False) as mon:
            for b in batches(fill):
                loss = loss_of(model, b)
                loss.backward()
                opt.step()
                opt.zero_grad()
                mon.log(loss=loss, **{how: b if how == "batch" else b["attention_mask"]})
        dfs[f"own {how}="] = nbwatch.open_run(tmp_path / how).df

    for key in ("attention_mask", "mask"):
        lightning_fit(tmp_path, model_opt()[0], loss_of, batches(fill, key),
                      tmp_path / f"pl_{key}")
        dfs[f"lightning {key}"] = nbwatch.open_run(tmp_path / f"pl_{key}").df

    transformers = pytest.importorskip("transformers")
    from nbwatch.hf import NbwatchCallback

    cfg = transformers.LlamaConfig(vocab_size=60, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=64)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        logging_strategy="no")
    data = [{**b, "labels": b["input_ids"]} for b in batches(fill)]
    trainer = transformers.Trainer(
        model=transformers.LlamaForCausalLM(cfg), args=args,
        train_dataset=[{"input_ids": [1]}] * 6,
        callbacks=[NbwatchCallback(run_dir=tmp_path / "hf")])
    trainer.get_train_dataloader = lambda: torch.utils.data.DataLoader(data, batch_size=None)
    trainer.train()
    dfs["trainer"] = nbwatch.open_run(tmp_path / "hf").df
    for name, df in dfs.items():
        check(df, name)


@pytest.mark.parametrize("fill", FILLS.values(), ids=FILLS.keys())
def test_an_additive_mask_weighs_the_loss_and_log_z_as_its_0_1_one(tmp_path, fill):
    """start(): a step's additive mask weighs nbwatch's masked token mean (the loss it
    trains on) and log Z as the 0/1 mask it stands for; the batch's additive
    attention_mask weighs log Z of a `{'logits', 'labels'}` step."""
    expected: dict[str, list[list[float]]] = {"mask": [], "batch": []}

    def step(with_mask: bool):
        def step_fn(model, b):
            additive, real = masks(fill)
            ids = b["input_ids"]
            logits = model(ids)[:, :-1]
            labels = ids[:, 1:]
            want = nbwatch.masked_cross_entropy(logits.detach(), labels, real[:, 1:])
            parts = logit_parts(logits.detach(), real[:, 1:])
            expected["mask" if with_mask else "batch"].append(
                [float(want), *(float(p) for p in parts)])
            out = {"logits": logits, "labels": labels}
            return {**out, "mask": additive[:, 1:]} if with_mask else out
        return step_fn

    for with_mask in (True, False):
        model, opt = model_opt()
        name = "mask" if with_mask else "batch"
        # (a mask read upside down made the loss NaN: recorded, not paused on)
        mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / name, display=False,
                              alerts={"nonfinite": {"actions": []}})
        mon.start(step(with_mask), batches(fill), max_steps=3)
        mon.wait()
        assert mon.state == "finished", mon.error
        got = mon.df[["train_logits/log_z", "train_logits/max_abs"]].to_numpy()
        want = np.array(expected[name])
        np.testing.assert_allclose(got, want[:, 1:], rtol=1e-5)
        if with_mask:  # the loss nbwatch computed over the 12 real labels
            np.testing.assert_allclose(mon.df["loss/train"].to_numpy(), want[:, 0], rtol=1e-5)


def test_a_float_mask_neither_0_1_nor_additive_is_refused_naming_both():
    """Positive entries beside negative ones: neither form; the refusal says what a 0/1
    mask and an additive one are."""
    from nbwatch.probes.data import additive_01, check_mask, decoder_mask

    mixed = torch.tensor([[1.0, 1.0, float("-inf")]])
    with pytest.raises(ValueError, match=r"holds -inf besides 0 and 1.*0/1.*additive "
                                         r"attention mask \(0.0 where a token is attended"):
        check_mask(additive_01(mixed), "mon.log()")
    additive, real = masks(float("-inf"))
    assert torch.equal(decoder_mask({"decoder_attention_mask": additive}), real)
    assert torch.equal(additive_01(torch.zeros(2, 3)), torch.ones(2, 3))  # masks nothing
    assert torch.equal(additive_01(real), real)


def test_a_float_loss_mask_of_zeros_alone_trains_on_nothing():
    """A fine-tuning step whose float 0/1 loss mask is zeros alone (one sample, its response
    truncated away) trains on no token, as it did before additive masks were read: taken
    for an additive mask that masks nothing, it trained on the prompt."""
    from nbwatch.probes.loss import masked_cross_entropy, parse_step_output

    torch.manual_seed(0)
    logits = torch.randn(1, 6, 11, requires_grad=True)
    labels = torch.randint(0, 11, (1, 6))
    zeros = torch.zeros(1, 6)
    assert float(masked_cross_entropy(logits, labels, zeros)) == 0.0
    additive = torch.tensor([[0.0, 0.0, 0.0, 0.0, float("-inf"), float("-inf")]])
    assert float(masked_cross_entropy(logits, labels, additive)) == pytest.approx(
        float(masked_cross_entropy(logits, labels, (additive == 0).float())))
    out = parse_step_output({"logits": logits, "labels": labels, "mask": zeros})
    assert float(out.mask.sum()) == 0.0


@pytest.mark.parametrize("returned", ["logits", "loss"])
def test_a_float_step_mask_of_zeros_alone_is_said(tmp_path, returned):
    """An additive loss mask (0.0 real, -inf padding) of a batch with no padding is zeros
    alone, read as a 0/1 mask with nothing to train on: its loss is 0 ({'logits',
    'labels', 'mask'}: masked_cross_entropy's), its tokens 0, its padding ratio 1. The run
    said nothing; it says so once, naming the way out (a 0/1 or bool mask)."""
    model, opt = model_opt()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 60, (1, 8), generator=g)} for _ in range(3)]

    def step(m, b):
        ids = b["input_ids"]
        logits = m(ids[:, :-1])
        out = {"logits": logits, "labels": ids[:, 1:], "mask": torch.zeros(1, 7)}
        if returned == "loss":
            out = {"loss": logits.logsumexp(-1).mean(), "mask": out["mask"]}
        return out

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    mon.start(step, data, max_steps=3, display=False).wait()
    assert mon.state == "finished"
    if returned == "logits":
        assert mon.df["loss/train"].tolist() == [0.0] * 3
    said = mon.events[mon.events.message.str.contains("zeros alone")]
    assert len(said) == 1 and said.severity.iloc[0] == "warning"
    assert "mask == 0" in said.message.iloc[0]
    assert "_mask_zeros" not in mon.df
