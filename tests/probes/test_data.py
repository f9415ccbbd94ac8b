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
