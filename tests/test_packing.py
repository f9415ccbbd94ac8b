"""Packed batches (Hugging Face's `DataCollatorWithFlattening`: sequences laid end to end in
one row, `position_ids` from 0 at each, no attention_mask, no padding): the step's sequence
figures, samples/s and sequence-length histogram are its documents', not its row's, under
start(), the Trainer and a loop of one's own (`mon.log(..., batch=batch)`); its tokens are
every token, its padding none."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.demo import make_demo
from tests.conftest import lightning_fit

LENGTHS = [[7, 3, 12, 6], [5, 9, 2, 10], [11, 4, 8, 1]]  # each step's documents


def packed(lengths: list[int], vocab: int = 60) -> dict[str, torch.Tensor]:
    """One packed row, as DataCollatorWithFlattening makes it."""
    ids = torch.randint(0, vocab, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, (pos[0] == 0).nonzero()[:, 0]] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def check_documents(df, lengths: list[list[int]], timed_from: int = 1) -> None:
    """`timed_from`: the first step with a time/step (a loop of one's own opens its run
    inside its first step, which has none)."""
    for step, docs in enumerate(lengths, start=1):
        row = df.loc[step]
        assert row["tokens/real"] == sum(docs)
        assert row["data/padding_ratio"] == 0.0
        assert row["data/seq_len_mean"] == pytest.approx(sum(docs) / len(docs))
        assert row["data/seq_len_max"] == max(docs)
        if step >= timed_from:
            assert row["throughput/samples_per_s"] == pytest.approx(
                len(docs) / row["time/step"])


def check_histograms(run_dir, lengths: list[list[int]]) -> None:
    """`data/seq_len` at each step (hist_every=1): that step's documents, not its row."""
    steps, edges, counts = nbwatch.open_run(run_dir).histograms("data/seq_len")
    assert steps.tolist() == list(range(1, len(lengths) + 1))
    for docs, e, c in zip(lengths, edges, counts):
        assert c.sum() == len(docs)  # one count a document (the row alone would be 1)
        assert e[-1] == max(docs)  # the range ends at the longest document, not the row
        assert (np.histogram(docs, bins=e)[0] == c).all()


def own_loop(tmp_path, batches, log):
    """A loop of one's own over packed rows of the demo model; `log(mon, loss, batch)`."""
    torch.manual_seed(0)
    model = make_demo(d=16, layers=1, heads=2, ctx=16).model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "own", display=False,
                         hist_every=1) as mon:
        for batch in batches:
            ids = batch["input_ids"][:, :16]
            loss = torch.nn.functional.cross_entropy(model(ids)[0, :-1], ids[0, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            log(mon, loss, batch)
    return nbwatch.open_run(tmp_path / "own").df


@pytest.fixture(params=[False, True], ids=["cpu-order", "gpu-order"])
def gpu_order(request, monkeypatch):
    """Both orders of a step: read at once (a CPU's), and an accelerator's (the figures,
    the documents' counts by length with them, copied at the step's end, read later)."""
    from nbwatch.probes import data
    from nbwatch.recorder import host_copy

    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", request.param)
    monkeypatch.setattr(data, "EXACT_ON_CPU", not request.param)  # a device's counts
    return request.param


@pytest.mark.parametrize("mask", [False, True])
def test_a_packed_batch_in_an_own_loop_counts_its_documents(tmp_path, mask, gpu_order):
    """`mon.log(loss=loss, batch=batch)`: the batch's position_ids give its documents, as
    under start(); with no mask, every token is real (a packed row has no padding)."""
    torch.manual_seed(0)
    batches = [packed(n) for n in LENGTHS]
    df = own_loop(tmp_path, batches, lambda mon, loss, b: mon.log(
        loss=loss, batch=b, mask=torch.ones_like(b["input_ids"]) if mask else None))
    check_documents(df, LENGTHS, timed_from=2)
    check_histograms(tmp_path / "own", LENGTHS)


def test_packed_micro_batches_in_an_own_loop_count_every_documents(tmp_path):
    """Under gradient accumulation, `batch=[b1, b2]`: the step's documents are both's."""
    torch.manual_seed(0)
    rows = [packed([n]) for n in itertools.chain(*LENGTHS)]  # one document a row
    pairs = [rows[i:i + 2] for i in range(0, 4, 2)]
    df = own_loop(tmp_path, [p[0] for p in pairs], lambda mon, loss, b: mon.log(
        loss=[loss, loss], batch=pairs[mon.step]))
    check_documents(df, [[7, 3], [12, 6]], timed_from=2)
    check_histograms(tmp_path / "own", [[7, 3], [12, 6]])


def test_a_packed_steps_document_lengths_are_counts_by_length():
    """A packed step's documents' lengths leave the device as counts by length, a vector a
    row long (not one entry a token): the histogram reads the same documents from them,
    micro-batches of two lengths and a document carried on from a row before included."""
    from nbwatch.probes.data import doc_length_counts, doc_lengths

    a = packed([7, 3, 12, 6])["position_ids"]
    b = torch.cat([torch.arange(5, 9), torch.arange(4)]).reshape(1, 8)  # carried on: 9
    got = doc_length_counts([a, b])
    assert got.counts.shape == (29,)  # the longest row's length + 1, whatever the batch
    assert sorted(got.lengths().tolist()) == [3.0, 4.0, 6.0, 7.0, 9.0, 12.0]
    assert sorted(doc_lengths([a, b]).tolist()) == [3.0, 4.0, 6.0, 7.0, 9.0, 12.0]
    c = torch.arange(40, 48).reshape(1, 8)  # past the longest row: counted at its length
    assert doc_length_counts([c]).lengths().tolist() == [8.0]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_position_ids_of_any_integer_type_give_their_documents_on_a_device(dtype):
    """`packed_positions` takes any integer position_ids: a device's counts by length index
    with them too (scatter_add_ takes int32/int64 indices alone, int64 alone in older
    torch: other types raised there, failing the step on an accelerator)."""
    from nbwatch.probes.data import doc_length_counts, documents

    pos = packed([7, 3, 12, 6])["position_ids"].to(dtype)
    assert sorted(doc_length_counts([pos]).lengths().tolist()) == [3.0, 6.0, 7.0, 12.0]
    names, parts = [], []
    documents([pos, pos[:, :10]], names, parts)
    assert [float(p) for p in parts] == [6.0, 12.0]  # 4 + 2 documents, the longest 12


@pytest.mark.parametrize("mask", [True, False])
def test_a_packed_batch_under_start_counts_its_documents(tmp_path, mask, gpu_order):
    """With no mask from the step_fn (a bare loss), every token is real, as in an own loop."""
    torch.manual_seed(0)
    demo = make_demo(d=16, layers=1, heads=2, ctx=16)
    model = demo.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step_fn(model, batch):  # a model that takes no positions: a packing-blind forward
        ids = batch["input_ids"][:, :16]
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        return {"loss": loss, "mask": torch.ones_like(batch["input_ids"])} if mask else loss

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False, hist_every=1)
    mon.start(step_fn, [packed(n) for n in LENGTHS], max_steps=len(LENGTHS))
    mon.wait()
    check_documents(mon.df, LENGTHS)
    check_histograms(tmp_path / "r", LENGTHS)


def test_a_packed_batch_under_the_trainer_counts_its_documents(tmp_path):
    transformers = pytest.importorskip("transformers")
    import nbwatch.hf

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=60, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    ds = [{"input_ids": torch.randint(0, 60, (n,)).tolist()} for n in itertools.chain(*LENGTHS)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        logging_strategy="no")
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=ds,
        data_collator=transformers.DataCollatorWithFlattening(),
        callbacks=[nbwatch.hf.NbwatchCallback(run_dir=tmp_path / "hf", hist_every=1)])
    trainer.get_train_dataloader = lambda: torch.utils.data.DataLoader(  # in order
        ds, batch_size=4, collate_fn=transformers.DataCollatorWithFlattening())
    trainer.train()
    check_documents(nbwatch.open_run(tmp_path / "hf").df, LENGTHS)
    check_histograms(tmp_path / "hf", LENGTHS)


def test_a_packed_batch_under_lightning_counts_its_documents(tmp_path):
    """Lightning's batch is the module's own: a packed one has no mask to read, and its
    tokens are every token (they were not counted at all before)."""
    def loss_of(net, batch):
        ids = batch["input_ids"][:, :16]
        return torch.nn.functional.cross_entropy(net(ids)[0, :-1], ids[0, 1:])

    torch.manual_seed(0)
    lightning_fit(tmp_path, make_demo(d=16, layers=1, heads=2, ctx=16).model, loss_of,
                  [packed(n) for n in LENGTHS], tmp_path / "pl", hist_every=1)
    check_documents(nbwatch.open_run(tmp_path / "pl").df, LENGTHS)
    check_histograms(tmp_path / "pl", LENGTHS)


def padded_rows() -> dict[str, torch.Tensor]:
    """Two rows of 8 with an attention_mask, 13 real tokens: a batch not packed."""
    ids = torch.randint(0, 60, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}


@pytest.mark.parametrize("loop", ["start", "own", "trainer", "lightning"])
def test_a_step_of_packed_and_padded_micro_batches_counts_both(tmp_path, loop, gpu_order):
    """Gradient accumulation over a packed micro-batch (no mask) and a padded one: the
    step's tokens are the packed row's, every one, and the padded rows' real ones; its
    samples are the packed row's documents and the padded rows, each of its own length
    (seq_len_mean, seq_len_max, samples/s, the histogram). The adapters counted the padded
    batch's tokens alone (the packed one gave no mask); samples and lengths were the
    documents' alone (a loop of one's own: the packed row as one sample)."""
    torch.manual_seed(0)
    batches = [packed([7, 3, 12, 6]), padded_rows(), packed([5, 2, 4]), padded_rows()]
    lengths = [[7, 3, 12, 6, 8, 5], [5, 2, 4, 8, 5]]  # the documents, then the rows
    every = [28 + 16, 11 + 16]  # tokens a step, padding included

    def loss_of(net, batch):
        ids = batch["input_ids"][:, :16]
        return torch.nn.functional.cross_entropy(net(ids)[0, :-1], ids[0, 1:])

    if loop == "start":
        model = make_demo(d=16, layers=1, heads=2, ctx=16).model
        mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              run_dir=tmp_path / "r", display=False, hist_every=1)
        mon.start(loss_of, batches, max_steps=2, accumulate=2)
        mon.wait()
    elif loop == "own":
        model = make_demo(d=16, layers=1, heads=2, ctx=16).model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False,
                             hist_every=1) as mon:
            for pair in (batches[:2], batches[2:]):
                losses = [loss_of(model, b) / 2 for b in pair]
                for one in losses:
                    one.backward()
                opt.step()
                opt.zero_grad()
                mon.log(loss=losses, batch=pair)
    elif loop == "trainer":
        transformers = pytest.importorskip("transformers")
        from nbwatch.hf import NbwatchCallback

        cfg = transformers.LlamaConfig(vocab_size=60, hidden_size=16, intermediate_size=32,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, max_position_embeddings=64)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=1, max_steps=2,
            gradient_accumulation_steps=2, report_to=[], save_strategy="no", use_cpu=True,
            disable_tqdm=True, logging_strategy="no")
        trainer = transformers.Trainer(
            model=transformers.LlamaForCausalLM(cfg), args=args,
            train_dataset=[{"input_ids": [1]}] * 4,
            callbacks=[NbwatchCallback(run_dir=tmp_path / "r", hist_every=1)])
        trainer.get_train_dataloader = lambda: torch.utils.data.DataLoader(
            batches, batch_size=None)
        trainer.train()
    else:
        lightning_fit(tmp_path, make_demo(d=16, layers=1, heads=2, ctx=16).model, loss_of,
                      batches, tmp_path / "r", max_steps=2, accumulate_grad_batches=2,
                      hist_every=1)
    df = nbwatch.open_run(tmp_path / "r").df
    for step, (docs, n) in enumerate(zip(lengths, every), start=1):
        row = df.loc[step]
        assert row["tokens/real"] == sum(docs)
        assert row["data/padding_ratio"] == pytest.approx(1 - sum(docs) / n)
        assert row["data/seq_len_mean"] == pytest.approx(sum(docs) / len(docs))
        assert row["data/seq_len_max"] == max(docs)
        if loop != "own" or step > 1:  # (its run opens inside its first step: no time)
            assert row["throughput/samples_per_s"] == pytest.approx(
                len(docs) / row["time/step"])
    check_histograms(tmp_path / "r", lengths)
