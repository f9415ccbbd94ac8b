import torch

from nbwatch.probes.data import mask_stats
from nbwatch.probes.throughput import add_rates, timing_figures


def test_padding_ratio_and_lengths_equal_the_masks():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    figs = mask_stats(mask)
    assert figs["tokens"].item() == 9
    assert figs["data/seq_len_mean"].item() == 3.0
    assert figs["data/seq_len_max"].item() == 5.0
    assert figs["lengths"].tolist() == [3, 5, 1]


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


def test_cpu_masks_keep_their_lengths_for_the_record_and_give_the_same_figures():
    from nbwatch.probes.data import batch_figures, length_figures
    from nbwatch.recorder.state import Later

    masks = [torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), torch.tensor([[1, 0, 0]])]
    names, parts, padded, lengths = batch_figures(masks)
    staged = dict(zip(names, [p.item() for p in parts]))
    later = Later()
    names2, parts2, padded2, lengths2 = batch_figures(masks, later)
    assert (names2, parts2, padded2) == ([], [], padded)
    assert later.lengths is lengths2 and lengths2.tolist() == lengths.tolist() == [3, 5, 1]
    assert length_figures(later.lengths.tolist(), later.groups) == staged
