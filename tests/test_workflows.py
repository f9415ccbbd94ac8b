"""Common workflows tried as a new user would (issue 13): settings before the run, the gap
at the first eval, wrong objectives caught early."""

import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.panels import Feed
from nbwatch.panels.loss import smooth
from nbwatch.store import RunReader
from tests.conftest import make_batches, tiny_step


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
    from nbwatch.adapters.hf import batch_mask

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
    assert int(batch_mask({"input_ids": ids, "attention_mask": am}).sum()) == 22
