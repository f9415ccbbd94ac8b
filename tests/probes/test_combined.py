"""`loader_batches`: which step's batch comes in parts, several loaders' (Lightning's
CombinedLoader, whose loaders it knows: their rows add up) or one batch's (a pair's
chosen and rejected: its own rows), the one rule every loop counts it by; the loops'
counts by hand are in test_throughput.py (`test_every_loop_counts_a_batch_in_parts_by_hand`)
and test_lightning.py (a real CombinedLoader fit)."""

import torch

from nbwatch.probes.combined import Split, loader_batches


def test_loader_batches_is_the_one_rule():
    """Unit: which batches come in parts (`loader_batches`), by their shape (one batch's
    parts), by the loaders a loop knows (Lightning's: loaders' batches), and for an
    encoder-decoder; the samples of each (`Split.rows`, `Split.overlap`)."""
    x, y = torch.randn(3, 4), torch.randn(3)
    a, b = {"input_ids": torch.ones(3, 2, dtype=torch.long)}, {"x": x, "y": y}
    assert loader_batches({"a": a, "b": b}) == Split([a, b], False)
    assert loader_batches([a, None, b]) == Split([a, b], False)
    assert loader_batches({"a": None, "b": [x, y]}) == Split([[x, y]], False)
    one = [{"x": x, "a": a}, (x, y), [(x, y), (x, y)], [x, y], x, None, {}, [], {"a": None},
           {"s": torch.tensor(1), "a": a, "b": b}, {"a": {"b": b}, "c": b}]
    for batch in one:
        assert loader_batches(batch) == Split([batch], False)
    assert loader_batches((a, b), enc_dec=True) == Split([(a, b)], False)  # (src, tgt)
    # the loaders a loop knows decide, where the batch has their shape
    pairs = [[x, y], [x[:2], y[:2]]]
    assert loader_batches(pairs, loaders=["dl_a", "dl_b"]) == Split(pairs, True)
    assert loader_batches((a, b), enc_dec=True, loaders=("dl_a", "dl_b")) == Split([a, b], True)
    assert loader_batches({"a": a, "b": {"c": b, "d": None}},
                          loaders={"a": 0, "b": {"c": 1, "d": 2}}) == Split([a, b], True)
    assert loader_batches(pairs, loaders=["dl_a"]) == Split([pairs], False)  # not their shape
    assert loader_batches({"a": x}, loaders="a DataLoader") == Split([{"a": x}], False)
    # samples: one batch's parts hold the same rows; loaders' batches add up
    pair = {"chosen": a, "rejected": {"input_ids": torch.ones(3, 5, dtype=torch.long)}}
    split = loader_batches(pair)
    assert (split.rows(pair), split.overlap(pair)) == (3, 3)
    both = {"a": a, "b": {"x": torch.randn(5, 4)}}
    split = loader_batches(both, loaders={"a": 0, "b": 1})
    assert (split.rows(both), split.overlap(both)) == (3 + 5, 0)
    assert loader_batches(a).overlap(a) == 0 and loader_batches(a).rows(a) == 3


def test_a_loaders_batch_in_parts_is_split_by_its_shape():
    """A loader whose batch comes in parts (a pair loader's chosen and rejected) beside
    another in the loaders a loop knows: each part counted for its tokens, the pair's rows
    once (`Split.inner`); the pair was one part, its tokens not counted."""
    c, r = ({"input_ids": torch.ones(3, n, dtype=torch.long)} for n in (5, 4))
    text = {"input_ids": torch.ones(2, 6, dtype=torch.long)}
    batch = {"pref": {"chosen": c, "rejected": r}, "sft": text}
    split = loader_batches(batch, loaders={"pref": 0, "sft": 1})
    assert split == Split([c, r, text], True, 3)
    assert (split.rows(batch), split.overlap(batch)) == (3 + 2, 3)
    one = [{"chosen": c, "rejected": r}]  # train_dataloaders=[dl]
    assert loader_batches(one, loaders=["dl"]) == Split([c, r], True, 3)
    assert loader_batches(one, loaders=["dl"]).rows(one) == 3


def test_a_batch_in_parts_with_a_packed_part_counts_its_documents():
    """A batch in parts with a packed part (`Split.held`): its parts' rows are not samples
    beside the documents (`Split.beside`), nor taken off (`overlap` 0); a pair beside a
    packed batch gives back the rows its parts count twice."""
    packed = {"input_ids": torch.ones(1, 9, dtype=torch.long),
              "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])}
    xy = [torch.randn(5, 4), torch.randn(5)]
    batch = {"text": packed, "target": xy}
    split = loader_batches(batch)
    assert split == Split([packed, xy], False, 0, (packed, xy))
    assert (split.overlap(batch), split.beside(batch, [xy])) == (0, 0)
    pair = {"chosen": {"input_ids": torch.ones(2, 5)}, "rejected": {"input_ids": torch.ones(2, 4)}}
    assert loader_batches(pair).beside(pair, []) == -2  # both parts' rows given back once
    assert loader_batches(xy).beside(xy, [xy]) == 5  # (x, y) beside a packed micro-batch
