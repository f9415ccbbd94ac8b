"""Packed batches (Hugging Face's `DataCollatorWithFlattening`: sequences laid end to end in
one row, `position_ids` from 0 at each, no attention_mask, no padding): the step's sequence
figures and samples/s are its documents', not its row's, under start() and the Trainer;
its tokens are every token, its padding none."""

from __future__ import annotations

import itertools

import pytest
import torch

import nbwatch
from nbwatch.demo import make_demo

LENGTHS = [[7, 3, 12, 6], [5, 9, 2, 10], [11, 4, 8, 1]]  # each step's documents


def packed(lengths: list[int], vocab: int = 60) -> dict[str, torch.Tensor]:
    """One packed row, as DataCollatorWithFlattening makes it."""
    ids = torch.randint(0, vocab, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, (pos[0] == 0).nonzero()[:, 0]] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def check_documents(df, lengths: list[list[int]]) -> None:
    for step, docs in enumerate(lengths, start=1):
        row = df.loc[step]
        assert row["tokens/real"] == sum(docs)
        assert row["data/padding_ratio"] == 0.0
        assert row["data/seq_len_mean"] == pytest.approx(sum(docs) / len(docs))
        assert row["data/seq_len_max"] == max(docs)
        assert row["throughput/samples_per_s"] == pytest.approx(len(docs) / row["time/step"])


def test_a_packed_batch_under_start_counts_its_documents(tmp_path):
    torch.manual_seed(0)
    demo = make_demo(d=16, layers=1, heads=2, ctx=16)
    model = demo.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step_fn(model, batch):  # a model that takes no positions: a packing-blind forward
        ids = batch["input_ids"][:, :16]
        logits = model(ids)
        return {"loss": torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]),
                "mask": torch.ones_like(batch["input_ids"])}

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    mon.start(step_fn, [packed(n) for n in LENGTHS], max_steps=len(LENGTHS))
    mon.wait()
    check_documents(mon.df, LENGTHS)


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
        callbacks=[nbwatch.hf.NbwatchCallback(run_dir=tmp_path / "hf")])
    trainer.get_train_dataloader = lambda: torch.utils.data.DataLoader(  # in order
        ds, batch_size=4, collate_fn=transformers.DataCollatorWithFlattening())
    trainer.train()
    check_documents(nbwatch.open_run(tmp_path / "hf").df, LENGTHS)
