"""Common workflows tried as a new user would (issue 13): settings before the run, the gap
at the first eval, wrong objectives caught early."""

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.panels import Feed
from nbwatch.panels.loss import smooth
from nbwatch.probes.data import input_tokens
from nbwatch.store import RunReader
from tests.conftest import lightning_fit, make_batches, tiny_step


def new_tiny(seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("how", ["start", "set_clip", "monitor"])
def test_clipping_set_before_the_run_clips_step_1_and_is_in_the_config(tmp_path, how):
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / how,
                          **({"clip": 0.05} if how == "monitor" else {}))
    if how == "set_clip":
        mon.set_clip(0.05)
    mon.start(tiny_step, make_batches(), max_steps=3, display=False,
              **({"clip": 0.05} if how == "start" else {}))
    mon.wait()
    df = mon.df
    assert (df["grad_norm/global"] > 0.05).all()
    assert df["grad_norm/clipped"].tolist() == pytest.approx([0.05] * 3, rel=1e-5)
    assert nbwatch.open_run(tmp_path / how).config == {"clip": 0.05}


def test_the_gap_at_the_first_eval_is_val_minus_the_drawn_train_curve(tmp_path):
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(tiny_step, make_batches(), max_steps=30, val_fn=lambda m: 3.5, eval_every=30,
              display=False)
    mon.wait()
    df = mon.df
    drawn, _ = smooth(df["loss/train"].to_numpy())
    assert df.loc[30, "loss/gap"] == pytest.approx(3.5 - float(drawn[-1]), rel=1e-5)
    assert df.loc[30, "loss/gap"] != pytest.approx(3.5 - df["loss/train"].mean(), rel=1e-3)


def test_labels_equal_to_the_inputs_are_refused_with_the_shift(tmp_path):
    """A Hugging Face causal LM takes labels=input_ids and shifts inside; nbwatch's
    {'logits', 'labels'} form does not, so passing them unshifted would train a copier."""
    model, opt = new_tiny()

    def copying(model, batch):
        return {"logits": model(batch["input_ids"]), "labels": batch["input_ids"],
                "mask": batch["mask"]}

    def hf_labels(model, batch):  # what a HF collator makes: the inputs, -100 on padding
        labels = batch["input_ids"].masked_fill(batch["mask"] == 0, -100)
        return {"logits": model(batch["input_ids"]), "labels": labels, "mask": batch["mask"]}

    for i, step in enumerate((copying, hf_labels)):
        mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / f"run{i}")
        mon.start(step, make_batches(), max_steps=5, display=False)
        with pytest.raises(ValueError,
                           match=r"labels equal the batch's input_ids.*input_ids\[:, 1:\]"):
            mon.wait()
        assert mon.step == 0


def test_every_recorded_series_is_viewable_in_the_metrics_panel_and_the_export(tmp_path):
    """val/accuracy (a val_fn dict), lr/group1 (a second param group) and a step_fn dict's
    own scalar reach the metrics panel, live and in the export."""
    model, _ = new_tiny()
    opt = torch.optim.AdamW([{"params": model.blocks.parameters()},
                             {"params": [p for n, p in model.named_parameters()
                                         if not n.startswith("blocks")], "lr": 1e-4}], lr=1e-3)

    def step(model, batch):
        out = tiny_step(model, batch)
        out["my_metric"] = torch.tensor(0.5)
        return out

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(step, make_batches(), max_steps=6, display=False, eval_every=3,
              val_fn=lambda m: {"loss": 3.0, "accuracy": 0.25})
    mon.wait()
    df = mon.df
    assert df["train/my_metric"].tolist() == [0.5] * 6
    assert df["lr/group1"].dropna().iloc[0] == pytest.approx(1e-4)
    feed = Feed(RunReader(tmp_path / "run"))
    while feed.update() is not None or feed.more:
        pass
    shown = feed.full()["metrics"]["series"]
    assert {"val/accuracy", "lr/group1", "train/my_metric"} <= set(shown)
    assert shown["val/accuracy"]["y"].tolist() == [0.25, 0.25]
    assert "loss/train" not in shown  # drawn by the loss panel
    page = mon.export_html(tmp_path / "run.html").read_text()
    for key in ("val/accuracy", "lr/group1", "train/my_metric"):
        assert key in page


def test_the_probe_uses_probe_fn_not_step_fn_when_given(tmp_path):
    calls = {"step": 0, "probe": 0}

    def step(model, batch):
        calls["step"] += 1
        return tiny_step(model, batch)

    def probe(model, batch):
        calls["probe"] += 1
        return model(batch["input_ids"])

    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(step, make_batches(), max_steps=6, eval_every=2, probe_fn=probe, display=False)
    mon.wait()
    assert calls == {"step": 6, "probe": 4}  # the dry run and 3 evals
    assert sorted(nbwatch.open_run(tmp_path / "run").attention()) == [
        "blocks.0.attn", "blocks.1.attn"]


def test_a_broken_val_fn_fails_the_run_before_step_1(tmp_path):
    def broken(model):
        raise RuntimeError("val_fn broken on purpose")

    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(tiny_step, make_batches(), max_steps=100, val_fn=broken, eval_every=50,
              display=False)
    with pytest.raises(RuntimeError, match="dry run before step 1.*rather than at step 50"):
        mon.wait(timeout=30)
    assert mon.step == 0 and mon.state == "failed"


def test_a_step_fn_that_fails_in_the_dry_runs_probe_is_named(tmp_path):
    """The probe's forward is step_fn: its error says so, not only "val_fn, the attention
    probe or sample_fn" (a Hugging Face model's output indexed as logits, say)."""
    def step(model, batch):
        logits = model(batch["input_ids"])
        if not model.training:
            raise TypeError("tuple indices must be integers or slices, not tuple")
        return {"logits": logits[:, :-1], "labels": batch["input_ids"][:, 1:]}

    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(step, make_batches(), max_steps=10, eval_every=5, display=False)
    with pytest.raises(RuntimeError, match=r"dry run.*step_fn\(model, probe_batch\), raised.*"
                       r"TypeError: tuple indices.*probe_fn=lambda model, batch"):
        mon.wait(timeout=30)
    assert mon.step == 0 and mon.state == "failed"


def test_the_dry_run_leaves_training_exactly_as_without_it(tmp_path):
    """It draws random numbers (val_fn, the probe) and takes step 1's batch early: the RNG
    is restored and the batch handed back, so the weights end the same."""
    def noisy_val(model):
        return float(torch.rand(()))

    def noisy_step(model, batch):
        out = tiny_step(model, batch)
        out["logits"] = out["logits"] + 0.01 * torch.randn_like(out["logits"])
        return out

    finals = []
    for dry in (True, False):
        model, opt = new_tiny()
        mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / f"dry{dry}")
        mon.start(noisy_step, make_batches(), max_steps=6, val_fn=noisy_val, eval_every=3,
                  dry_run=dry, display=False)
        mon.wait()
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(finals[0], finals[1])


def test_an_encoder_decoders_labels_equal_to_its_inputs_are_a_copy_task(tmp_path):
    """A T5's decoder reads its labels shifted right, so {'logits', 'labels'} with labels
    equal to the source (a seq2seq copy task) are aligned: trained, not refused."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, decoder_start_token_id=0, pad_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def copy_task(model, batch):
        out = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
        return {"logits": out.logits, "labels": batch["input_ids"]}

    batches = ({"input_ids": torch.randint(2, 32, (2, 6))} for _ in range(3))
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", display=False)
    mon.start(copy_task, batches, max_steps=3)
    mon.wait()
    assert mon.state == "finished" and mon.step == 3



def test_logits_and_labels_without_a_mask_count_the_batchs_attention_mask(tmp_path):
    """`{'logits', 'labels'}` and no mask: the tokens are the batch's attention_mask (all
    the tokens the forward read, as the adapters count them; the loss weighs its [:, 1:]
    beside labels shifted by one), so tokens/s, padding and MFU are recorded; a
    masked LM's -100 labels are real tokens without a loss, not padding; a classifier of
    features has no tokens, a sequence classifier its attention_mask's."""
    ids = torch.randint(0, 64, (4, 17))
    am = torch.ones(4, 17, dtype=torch.long)
    am[0, 11:], am[1, 5:] = 0, 0  # 6 + 12 of 68 input tokens padded
    mlm = ids[:, 1:].clone()
    mlm[:, ::4] = -100  # a masked LM's: positions that take no loss

    for i, labels in enumerate((ids[:, 1:], mlm)):
        model, opt = new_tiny()
        mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / str(i), display=False)
        mon.start(lambda m, b: {"logits": m(b["input_ids"])[:, :-1], "labels": b["labels"]},
                  [{"input_ids": ids, "labels": labels, "attention_mask": am}] * 3,
                  max_steps=3)
        mon.wait()
        df = mon.df
        assert df["tokens/real"].tolist() == [50.0] * 3
        assert df["data/padding_ratio"].iloc[-1] == pytest.approx(18 / 68)
        assert df["throughput/tokens_per_s"].loc[2:].notna().all()

    head = torch.nn.Linear(8, 3)
    mon = nbwatch.Monitor(head, torch.optim.SGD(head.parameters(), lr=0.1),
                          run_dir=tmp_path / "classifier", display=False)
    mon.start(lambda m, b: {"logits": m(b["x"]), "labels": b["y"]},
              [{"x": torch.randn(5, 8), "y": torch.randint(0, 3, (5,))}] * 3, max_steps=3)
    mon.wait()
    assert mon.state == "finished" and "tokens/real" not in mon.df
    # a sequence classifier (one label a row) read the tokens of its attention_mask
    mon = nbwatch.Monitor(head, torch.optim.SGD(head.parameters(), lr=0.1),
                          run_dir=tmp_path / "sequences", display=False)
    mon.start(lambda m, b: {"logits": m(b["x"]), "labels": b["y"]},
              [{"x": torch.randn(4, 8), "y": torch.randint(0, 3, (4,)),
                "attention_mask": am}] * 3, max_steps=3)
    mon.wait()
    assert mon.df["tokens/real"].tolist() == [float(am.sum())] * 3


def test_a_loss_mask_that_leaves_out_real_tokens_counts_the_tokens_read(tmp_path):
    """start() with a step's loss mask that weighs only the answers (a fine-tuning
    prompt's tokens masked out) and is shifted by one: tokens/s, padding and lengths are
    the tokens the forward read, the batch's attention_mask, as under the Trainer; the
    prompt is no padding, so no padding alert fires."""
    ids = torch.randint(0, 64, (4, 17))
    am = torch.ones(4, 17, dtype=torch.long)
    am[0, 11:] = 0  # 6 of 68 input tokens padded
    loss_mask = am[:, 1:].clone()
    loss_mask[:, :10] = 0  # the prompt: 10 of each row's 16 targets weigh nothing

    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    mon.start(lambda m, b: {"logits": m(b["input_ids"])[:, :-1], "labels": b["input_ids"][:, 1:],
                            "mask": b["loss_mask"]},
              [{"input_ids": ids, "attention_mask": am, "loss_mask": loss_mask}] * 4,
              max_steps=4)
    mon.wait()
    assert mon.state == "finished", mon.error
    df = mon.df
    assert df["tokens/real"].tolist() == [62.0] * 4
    assert df["data/padding_ratio"].iloc[-1] == pytest.approx(6 / 68)
    assert df["data/seq_len_mean"].iloc[-1] == pytest.approx(62 / 4)
    assert not mon.events.message.str.contains("padding").any()


def test_a_packers_segment_ids_in_the_attention_mask_are_real_tokens(tmp_path):
    """A packer's attention_mask of segment ids (1, 2, 3 … a document, 0 padding) is the
    batch's, not the step's: its nonzero entries are the real tokens, and the run is not
    refused for a mask of other values than 0 and 1 (under the Trainer too)."""
    ids = torch.randint(0, 64, (2, 12))
    am = torch.tensor([[1] * 4 + [2] * 5 + [3] * 3, [1] * 6 + [2] * 4 + [0] * 2])
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    mon.start(lambda m, b: {"logits": m(b["input_ids"])[:, :-1], "labels": b["input_ids"][:, 1:]},
              [{"input_ids": ids, "attention_mask": am}] * 3, max_steps=3)
    mon.wait()
    assert mon.state == "finished", mon.error
    assert mon.df["tokens/real"].tolist() == [22.0] * 3
    assert mon.df["data/padding_ratio"].iloc[-1] == pytest.approx(2 / 24)
    assert int(input_tokens({"input_ids": ids, "attention_mask": am}).sum()) == 22


def _t5_batch(source: bool = True) -> dict[str, torch.Tensor]:
    """4 rows, source and target both 8 long (so the two masks have one shape): the source's
    real lengths 8, 5, 3, 6 (22 of 32), the target's 2, 7, 4, 1 (14 of 32); `source=False`
    leaves out its attention_mask (every source token real: 32)."""
    g = torch.Generator().manual_seed(0)
    src = torch.arange(8)[None, :] < torch.tensor([[8], [5], [3], [6]])
    tgt = torch.arange(8)[None, :] < torch.tensor([[2], [7], [4], [1]])
    batch = {"input_ids": torch.randint(2, 64, (4, 8), generator=g) * src,
             "labels": torch.randint(2, 64, (4, 8), generator=g).masked_fill(~tgt, -100)}
    if source:
        batch["attention_mask"] = src.long()
    return batch


def _t5():
    import transformers as tf

    torch.manual_seed(0)
    return tf.T5ForConditionalGeneration(tf.T5Config(
        d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=64,
        decoder_start_token_id=0, pad_token_id=0))


def _source_figures(df, run_dir, tokens, padding, mean, longest, lengths):
    assert df["tokens/real"].tolist() == [tokens] * len(df)
    assert df["data/padding_ratio"].tolist() == pytest.approx([padding] * len(df))
    assert df["data/seq_len_mean"].tolist() == pytest.approx([mean] * len(df))
    assert df["data/seq_len_max"].tolist() == [longest] * len(df)
    # tokens/s (MFU's token count) is these tokens over the step's time
    later = df.loc[2:]
    assert (later["throughput/tokens_per_s"] * later["time/step"]).tolist() == \
        pytest.approx([tokens] * len(later), rel=1e-3)
    _, edges, counts = nbwatch.open_run(run_dir).histograms("data/seq_len")
    n = int(counts[-1].sum()) // len(lengths)
    assert counts[-1].tolist() == np.histogram(lengths * n, bins=edges[-1])[0].tolist()


def test_an_encoder_decoders_data_figures_are_its_sources_in_every_loop(tmp_path):
    """A T5's tokens/real, tokens/s (and MFU's token count), padding, lengths and the
    `data/seq_len` histogram are its source's, the encoder's input, in `start()` whatever
    the step returns, under the Trainer (what its `num_input_tokens_seen` counts) and in a
    loop of your own given the batch's attention_mask; never the target's, which weighs
    the loss and the logits' log Z. `start()` counted the step's mask (the target's) where
    the batch had no attention_mask, and weighed log Z by the source's mask."""
    tf = pytest.importorskip("transformers")
    import nbwatch.hf
    from nbwatch.probes.logit_rows import logit_parts

    src = (22.0, 10 / 32, 5.5, 8.0, [8, 5, 3, 6])
    whole = (32.0, 0.0, 8.0, 8.0, [8, 8, 8, 8])  # no attention_mask: every source token
    expected: list[list[float]] = []

    def logits_labels(m, b):
        out = m(**b)
        expected.append([float(t) for t in logit_parts(out.logits.detach(), b["labels"] != -100)])
        return {"logits": out.logits, "labels": b["labels"]}

    steps = {"loss": lambda m, b: m(**b).loss,
             "target mask": lambda m, b: {"loss": m(**b).loss, "mask": b["labels"] != -100},
             "logits": logits_labels}
    for source, want in ((True, src), (False, whole)):
        for name, step_fn in steps.items():
            expected.clear()
            model = _t5()
            run_dir = tmp_path / f"{name}{source}"
            mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  run_dir=run_dir, display=False)
            mon.start(step_fn, [_t5_batch(source)] * 3, max_steps=3)
            mon.wait()
            assert mon.state == "finished", mon.error
            _source_figures(mon.df, run_dir, *want)
            if expected:  # the logits' log Z over the target's real positions
                got = mon.df[["train_logits/log_z", "train_logits/max_abs"]].to_numpy()
                np.testing.assert_allclose(got, np.array(expected), rtol=1e-5)

    # a loop of your own, given the source's mask as docs/loops.md shows
    model = _t5()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "own", display=False)

    expected.clear()

    def train():
        for batch in [_t5_batch()] * 3:
            out = model(**batch)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            expected.append([float(t) for t in logit_parts(out.logits.detach(),
                                                           batch["labels"] != -100)])
            mon.log(loss=out.loss, mask=batch["attention_mask"], batch=batch, logits=out.logits)

    mon.run(train)
    mon.wait()
    assert mon.state == "finished", mon.error
    _source_figures(mon.df, tmp_path / "own", *src)
    # its logits weighed by the target's real positions, not by the mask given (the source's)
    got = mon.df[["train_logits/log_z", "train_logits/max_abs"]].to_numpy()
    np.testing.assert_allclose(got, np.array(expected), rtol=1e-5)

    # ... or given the batch alone: its source's tokens, its logits over the target's
    for source, want in ((True, src), (False, whole)):
        expected.clear()
        model = _t5()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run_dir = tmp_path / f"own_batch{source}"
        with nbwatch.Monitor(model, opt, run_dir=run_dir, display=False) as mon:
            for batch in [_t5_batch(source)] * 3:
                out = model(**batch)
                out.loss.backward()
                opt.step()
                opt.zero_grad()
                expected.append([float(t) for t in logit_parts(out.logits.detach(),
                                                               batch["labels"] != -100)])
                mon.log(loss=out.loss, batch=batch, logits=out.logits)
        df = nbwatch.open_run(run_dir).df
        _source_figures(df, run_dir, *want)
        got = df[["train_logits/log_z", "train_logits/max_abs"]].to_numpy()
        np.testing.assert_allclose(got, np.array(expected), rtol=1e-5)

    # the Trainer: its num_input_tokens_seen ("non_padding") counts the same tokens
    class Rows(torch.utils.data.Dataset):
        def __init__(self, source):
            self.batch = _t5_batch(source)

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {k: v[i] for k, v in self.batch.items()}

    for source, want in ((True, src), (False, whole)):
        trainer = tf.Trainer(
            model=_t5(), train_dataset=Rows(source),
            data_collator=lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]},
            args=tf.TrainingArguments(
                output_dir=str(tmp_path / f"out{source}"), max_steps=3,
                per_device_train_batch_size=4, report_to=[], save_strategy="no",
                use_cpu=True, disable_tqdm=True, log_level="error",
                include_num_input_tokens_seen="non_padding"))
        run = nbwatch.hf.start(trainer, run_dir=tmp_path / f"hf{source}", display=False)
        run.wait()
        assert run.state == "finished", run.error
        _source_figures(run.df, tmp_path / f"hf{source}", *want)
        assert trainer.state.num_input_tokens_seen == 3 * want[0]


def test_a_batch_of_input_ids_alone_counts_every_token_in_every_loop(tmp_path):
    """A decoder-only batch with no attention_mask (fixed-length rows, nanoGPT's): every
    token is real in `start()` (a step returning a bare loss), a loop of your own given
    the batch, and Lightning, as the Trainer counts `num_input_tokens_seen`; they recorded
    no tokens, tokens/s or MFU at all."""
    from nbwatch.demo import TinyGPT

    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 64, (4, 17), generator=g)} for _ in range(3)]

    def loss_of(model, b):
        logits = model(b["input_ids"][:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 b["input_ids"][:, 1:].flatten())

    def model_opt():
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, d=16, layers=1, heads=2, ctx=32)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = model_opt()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "start", display=False)
    mon.start(loss_of, batches, max_steps=3)
    mon.wait()
    dfs = {"start": mon.df}

    model, opt = model_opt()
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "own", display=False) as mon:
        for b in batches:
            loss_of(model, b).backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss_of(model, b).detach(), batch=b)
    dfs["own"] = nbwatch.open_run(tmp_path / "own").df

    lightning_fit(tmp_path, model_opt()[0], loss_of, batches, tmp_path / "pl")
    dfs["lightning"] = nbwatch.open_run(tmp_path / "pl").df
    for name, df in dfs.items():
        assert df["tokens/real"].tolist() == [68.0] * 3, name
        assert df["data/padding_ratio"].tolist() == [0.0] * 3, name
        assert (df.loc[2:, "throughput/tokens_per_s"] * df.loc[2:, "time/step"]).tolist() == \
            pytest.approx([68.0] * 2, rel=1e-3), name


def test_an_encoder_decoders_step_mask_that_is_not_0_1_is_still_refused(tmp_path):
    """start(): an encoder-decoder's data figures come from its source, not from the mask
    its step returns (the target's), but that mask still weighs its loss and log Z: one of
    other values than 0 and 1 fails the first step, as it did while it was counted (a
    batch without an attention_mask), with or without the source's attention_mask."""
    pytest.importorskip("transformers")
    steps = {"logits": lambda m, b: {"logits": m(**b).logits, "labels": b["labels"],
                                     "mask": (b["labels"] != -100).long() * 2},
             "loss": lambda m, b: {"loss": m(**b).loss, "mask": b["labels"].clamp(min=0)}}
    for source in (False, True):
        for name, step_fn in steps.items():
            model = _t5()
            mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  run_dir=tmp_path / f"{name}{source}", display=False)
            mon.start(step_fn, [_t5_batch(source)] * 3, max_steps=3)
            with pytest.raises(ValueError, match=r"step_fn's mask.*besides 0 and 1.*"
                               r"target's real tokens.*decoder_attention_mask"):
                mon.wait()
            assert mon.state == "failed" and mon.step == 0
    # a good target mask trains, its figures the source's
    model = _t5()
    mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                          run_dir=tmp_path / "good", display=False)
    mon.start(lambda m, b: {"loss": m(**b).loss, "mask": (b["labels"] != -100).long()},
              [_t5_batch(False)] * 3, max_steps=3)
    mon.wait()
    assert mon.state == "finished", mon.error
    assert mon.df["tokens/real"].tolist() == [32.0] * 3


def test_a_models_own_4d_attention_mask_is_not_counted_as_tokens(tmp_path):
    """A batch whose attention_mask is the model's own [batch, 1, T, T] mask (not one of its
    tokens) and a step returning a bare loss: start() records no data figures, as before
    every input_ids token of a batch without a mask was counted; it counted that mask's
    T x T entries as tokens (17x the tokens, tokens/s and MFU)."""
    from nbwatch.demo import TinyGPT

    g = torch.Generator().manual_seed(0)
    am = torch.ones(4, 17, dtype=torch.long)
    am[:, 12:] = 0
    batches = [{"input_ids": torch.randint(0, 64, (4, 17), generator=g),
                "attention_mask": am[:, None, None, :].expand(4, 1, 17, 17)} for _ in range(3)]

    def loss_of(model, b):
        logits = model(b["input_ids"][:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 b["input_ids"][:, 1:].flatten())

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=16, layers=1, heads=2, ctx=32)
    mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                          run_dir=tmp_path / "start", display=False)
    mon.start(loss_of, batches, max_steps=3)
    mon.wait()
    assert mon.state == "finished", mon.error
    assert "tokens/real" not in mon.df.columns or mon.df["tokens/real"].isna().all()

    # Lightning counted the mask's T x T entries too
    lightning_fit(tmp_path, TinyGPT(vocab=64, d=16, layers=1, heads=2, ctx=32), loss_of,
                  batches, tmp_path / "pl")
    df = nbwatch.open_run(tmp_path / "pl").df
    assert "tokens/real" not in df.columns or df["tokens/real"].isna().all()


def _no_tokens(df) -> None:
    for name in ("tokens/real", "throughput/tokens_per_s", "data/padding_ratio",
                 "data/seq_len_mean"):
        assert name not in df.columns or df[name].isna().all(), name


def test_an_encoder_decoders_source_mask_given_alone_does_not_weigh_its_logits(tmp_path):
    """A loop of one's own that gives a T5's source mask as `log(mask=...)` (as the docs
    say to) and no batch: its logits are the target's, so log Z is over every target
    position. It was weighed by the source's mask (same length here; with labels shifted
    by hand, a position apart too)."""
    pytest.importorskip("transformers")
    from nbwatch.probes.logit_rows import logit_parts

    model = _t5()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expected = []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        for batch in [_t5_batch()] * 3:
            out = model(**batch)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            expected.append([float(t) for t in logit_parts(out.logits.detach())])
            mon.log(loss=out.loss, mask=batch["attention_mask"], logits=out.logits)
    df = nbwatch.open_run(tmp_path / "r").df
    _source_figures(df, tmp_path / "r", 22.0, 10 / 32, 5.5, 8.0, [8, 5, 3, 6])
    got = df[["train_logits/log_z", "train_logits/max_abs"]].to_numpy()
    np.testing.assert_allclose(got, np.array(expected), rtol=1e-5)


def test_an_encoder_decoders_batch_as_a_tuple_counts_no_tokens_in_every_loop(tmp_path):
    """A T5 batch as a tuple names neither its source nor its target: no token figures in
    any loop (not the target's, whose mask start()'s step returns), its samples/s its
    first tensor's rows; so too a model of PyTorch's own `nn.Transformer`, whose step's
    mask (the target's) start() counted. A loop of one's own that gave `log(batch=(src, tgt))`, two
    tokenizer outputs and one backward pass, counted them as two micro-batches: the
    target's 14 tokens and 4 rows beside the source's 22 and 4 (36 tokens, 8 samples):
    no tokens now, and 4 samples (a pair of dicts: the first one's rows)."""
    pytest.importorskip("transformers")
    b = _t5_batch()
    tup = (b["input_ids"], b["attention_mask"], b["labels"])

    def forward(m, t):
        return m(input_ids=t[0], attention_mask=t[1], labels=t[2])

    steps = {"loss": lambda m, t: forward(m, t).loss,
             "target mask": lambda m, t: {"loss": forward(m, t).loss, "mask": t[2] != -100}}
    dfs = {}
    for name, step_fn in steps.items():
        model = _t5()
        mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              run_dir=tmp_path / name, display=False)
        mon.start(step_fn, [tup] * 3, max_steps=3)
        mon.wait()
        assert mon.state == "finished", mon.error
        dfs[name] = mon.df
    lightning_fit(tmp_path, _t5(), lambda net, t: forward(net, t).loss, [tup] * 3,
                  tmp_path / "pl")
    dfs["lightning"] = nbwatch.open_run(tmp_path / "pl").df

    class Seq2Seq(torch.nn.Module):  # PyTorch's own nn.Transformer: no config to say so
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(64, 16)
            self.tf = torch.nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
            self.out = torch.nn.Linear(16, 64)

        def forward(self, src, tgt):
            return self.out(self.tf(self.emb(src), self.emb(tgt)))

    def seq2seq_step(m, t):  # its mask the target's: it counted 14 tokens, the target's
        logits = m(t[0], t[2].clamp(min=0))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), t[2].flatten()),
                "mask": t[2] != -100}

    torch.manual_seed(0)
    model = Seq2Seq()
    mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                          run_dir=tmp_path / "nn", display=False)
    mon.start(seq2seq_step, [tup] * 3, max_steps=3)
    mon.wait()
    assert mon.state == "finished", mon.error
    dfs["nn.Transformer"] = mon.df
    for name, df in dfs.items():
        _no_tokens(df)
        later = df.loc[2:]
        assert (later["throughput/samples_per_s"] * later["time/step"]).tolist() == \
            pytest.approx([4.0] * 2, rel=1e-3), name

    # a loop of one's own: (src, tgt) is one batch; [b1, b2] with a backward each is two
    src = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
    tgt = {"input_ids": b["labels"].clamp(min=0), "attention_mask": (b["labels"] != -100).long()}
    for name, pairs in (("pair", False), ("micro", True)):
        model = _t5()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / name, display=False) as mon:
            for _ in range(3):
                if pairs:
                    losses = [model(**b).loss for _ in range(2)]
                    for one in losses:
                        (one / 2).backward()
                    given = {"loss": losses, "batch": [b, b]}
                else:
                    loss = model(**src, labels=b["labels"]).loss
                    loss.backward()
                    given = {"loss": loss, "batch": (src, tgt)}
                opt.step()
                opt.zero_grad()
                mon.log(**given)
        df = nbwatch.open_run(tmp_path / name).df
        if pairs:  # the two micro-batches' sources
            assert df["tokens/real"].tolist() == [44.0] * 3
            assert df["data/seq_len_mean"].tolist() == pytest.approx([5.5] * 3)
        else:  # its samples the source's rows, from their shape (`batch_samples`)
            _no_tokens(df)
            later = df.loc[2:]
            assert (later["throughput/samples_per_s"] * later["time/step"]).tolist() == \
                pytest.approx([4.0] * 2, rel=1e-3)
