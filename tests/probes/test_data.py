import pytest
import torch

from nbwatch.probes.data import batch_figures, input_tokens, mask_stats
from nbwatch.probes.throughput import add_rates, timing_figures


def test_padding_ratio_and_lengths_equal_the_masks():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    figs = mask_stats(mask)
    assert figs["tokens"].item() == 9
    assert figs["data/seq_len_mean"].item() == 3.0
    assert figs["data/seq_len_max"].item() == 5.0
    assert figs["lengths"].tolist() == [3, 5, 1]


def test_a_batchs_input_tokens_are_its_attention_masks_else_its_input_ids():
    """The data figures' tokens (an encoder-decoder's: its source's): the attention_mask's
    nonzero entries (a packer's segment ids too), else every token of a 2-D integer
    input_ids, as the Trainer's num_input_tokens_seen counts; never the labels'."""
    ids = torch.randint(2, 64, (2, 4))
    am = torch.tensor([[1, 1, 0, 0], [1, 2, 2, 0]])
    labels = torch.tensor([[5, -100, -100, -100], [5, 6, 7, 8]])
    got = input_tokens({"input_ids": ids, "attention_mask": am, "labels": labels})
    assert got.tolist() == [[True, True, False, False], [True, True, True, False]]
    got = input_tokens({"input_ids": ids, "labels": labels})
    assert got.dtype == torch.bool and got.shape == (2, 4) and bool(got.all())
    for no in ({"input_ids": ids.float()}, {"pixel_values": torch.rand(2, 3)}, ids, None,
               # a model's own [batch, 1, T, T] mask: not its tokens (nor is every input_ids
               # token real: it masks padding too); an empty batch: no tokens to count
               {"input_ids": ids, "attention_mask": am[:, None, None, :].expand(2, 1, 4, 4)},
               {"input_ids": ids[:0], "attention_mask": am[:0]}, {"input_ids": ids[:0]}):
        assert input_tokens(no) is None
    # a multiple-choice batch's [batch, choices, T] mask is its input_ids' own
    mc = input_tokens({"input_ids": ids[:, None].expand(2, 3, 4),
                       "attention_mask": am[:, None].expand(2, 3, 4)})
    assert mc.shape == (2, 3, 4) and mc.sum() == 3 * 5


@pytest.mark.parametrize("dtype", [torch.bool, torch.long, torch.int32, torch.int8,
                                   torch.uint8, torch.float32, torch.float16, torch.bfloat16])
def test_a_cpu_mask_read_on_the_host_gives_the_device_figures(dtype):
    """CPU masks are read with numpy (no torch op): the same figures as `mask_stats` gives
    on a device, for every dtype a mask comes in, 1-D and over micro-batches of unequal
    sizes (the mean over all their sequences, as on the device)."""
    g = torch.Generator().manual_seed(0)
    masks = [(torch.rand(b, 7, generator=g) > 0.3).to(dtype) for b in (4, 2)]
    masks.append((torch.rand(5, generator=g) > 0.5).to(dtype))
    for some in (masks[:1], masks[2:], masks):
        mf = batch_figures(some)
        figs = [mask_stats(m) for m in some]
        got = dict(mf.host) or dict(zip(mf.names, (float(p) for p in mf.parts)))
        lengths = torch.cat([f["lengths"] for f in figs])
        mean = float(lengths.sum() / lengths.numel())
        assert got == {
            "tokens/real": float(sum(f["tokens"] for f in figs)),
            "data/seq_len_mean": pytest.approx(mean, rel=1e-6, abs=0),
            "data/seq_len_max": float(max(f["data/seq_len_max"] for f in figs))}
        assert mf.lengths.tolist() == torch.cat([f["lengths"] for f in figs]).tolist()
        assert mf.padded == sum(m.numel() for m in some)
    assert (dtype == torch.bfloat16) == bool(batch_figures(masks).parts)  # numpy has no bf16


@pytest.mark.parametrize("dtype", [torch.long, torch.bfloat16])  # the host's, the device's
def test_the_mean_length_is_over_every_sequence_of_unequal_micro_batches(dtype):
    """Micro-batches of 3 sequences of length 2 and 1 of length 8 (token-budget batching):
    the mean length is 14 / 4 = 3.5, not the mean of the two batches' means (5)."""
    masks = [torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0]] * 3, dtype=dtype),
             torch.ones(1, 8, dtype=dtype)]
    mf = batch_figures(masks)
    got = dict(mf.host) or dict(zip(mf.names, (float(p) for p in mf.parts)))
    assert got["tokens/real"] == 14.0
    assert got["data/seq_len_mean"] == 3.5 == float(mf.lengths.mean())
    assert got["data/seq_len_max"] == 8.0


@pytest.mark.filterwarnings("error")  # a large value overflows the check: said, not warned
@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, float("nan"), 1e30])
def test_a_cpu_mask_with_other_values_than_0_and_1_is_refused(bad):
    mask = torch.ones(2, 4)
    mask[1, 2] = bad
    with pytest.raises(ValueError, match="besides 0 and 1"):
        batch_figures([mask])
    if bad != 1e30:
        with pytest.raises(ValueError, match="besides 0 and 1"):
            batch_figures([(mask * 150).half()])  # 300 overflows a float16 product
    with pytest.raises(ValueError, match="besides 0 and 1"):
        batch_figures([torch.ones(2, 4, dtype=torch.long), mask.long() * 2])
    if bad == -1.0:  # as unsigned, the host's check reads -1 as the largest value
        for dtype in (torch.int8, torch.int32, torch.long):
            with pytest.raises(ValueError, match="besides 0 and 1"):
                batch_figures([mask.to(dtype)])


def test_timing_split_and_throughput():
    f = timing_figures(step_s=0.5, data_s=0.1)
    assert f["time/compute"] == 0.4
    f["tokens/real"] = 1000.0
    add_rates(f, samples=8)
    assert f["throughput/tokens_per_s"] == 2000
    assert f["throughput/samples_per_s"] == 16
    own = timing_figures(0.5)  # a loop of the user's: no data wait seen
    add_rates(own, None)
    assert own == {"time/step": 0.5}
