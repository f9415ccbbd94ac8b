"""`loader_batches`: which step's batch is several loaders' batches (Lightning's
CombinedLoader), the one rule every loop counts it by; the loops' counts by hand are in
test_throughput.py (`test_every_loop_counts_every_loaders_batch_by_hand`) and
test_lightning.py (a real CombinedLoader fit)."""

import torch

from nbwatch.probes.combined import loader_batches


def test_loader_batches_is_the_one_rule():
    """Unit: which batches are several loaders' (`loader_batches`), by their shape, by the
    loaders a loop knows (Lightning's), and for an encoder-decoder."""
    x, y = torch.randn(3, 4), torch.randn(3)
    a, b = {"input_ids": torch.ones(3, 2, dtype=torch.long)}, {"x": x, "y": y}
    assert loader_batches({"a": a, "b": b}) == [a, b]
    assert loader_batches([a, None, b]) == [a, b]  # max_size: a loader run out
    assert loader_batches({"a": None, "b": [x, y]}) == [[x, y]]
    one = [{"x": x, "a": a}, (x, y), [(x, y), (x, y)], [x, y], x, None, {}, [], {"a": None},
           {"s": torch.tensor(1), "a": a, "b": b}, {"a": {"b": b}, "c": b}]
    for batch in one:
        assert loader_batches(batch) == [batch]
    assert loader_batches((a, b), enc_dec=True) == [(a, b)]  # (src, tgt): one batch
    # the loaders a loop knows decide, where the batch has their shape
    pairs = [[x, y], [x[:2], y[:2]]]
    assert loader_batches(pairs, loaders=["dl_a", "dl_b"]) == pairs
    assert loader_batches((a, b), enc_dec=True, loaders=("dl_a", "dl_b")) == [a, b]
    assert loader_batches({"a": a, "b": {"c": b, "d": None}},
                          loaders={"a": 0, "b": {"c": 1, "d": 2}}) == [a, b]
    assert loader_batches(pairs, loaders=["dl_a"]) == [pairs]  # not their shape
    assert loader_batches({"a": x}, loaders="a DataLoader") == [{"a": x}]
