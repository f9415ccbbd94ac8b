import numpy as np
import torch

from nbwatch.probes.grads import Layers
from nbwatch.probes.weights import histogram, layer_histograms, snapshot, update_ratios


def test_histogram_equals_numpy_histogram():
    g = torch.Generator().manual_seed(1)
    for x in (torch.randn(10_000, generator=g), torch.rand(777, generator=g) * 1e-3 - 5,
              torch.tensor([3.0, 3.0, 3.0])):
        edges, counts = histogram(x, 64)
        ref_counts, ref_edges = np.histogram(x.numpy(), bins=edges.numpy())
        np.testing.assert_array_equal(counts.numpy(), ref_counts)
        assert counts.sum() == x.numel()
        # and the bins are numpy's own equal-width bins over [min, max]
        np_counts, np_edges = np.histogram(x.numpy(), bins=64)
        np.testing.assert_allclose(edges.numpy(), np_edges, rtol=1e-5, atol=1e-6)
        assert np.abs(counts.numpy() - np_counts).sum() <= 2  # float32 vs float64 edges


def test_values_on_and_next_to_the_edges_fall_as_numpy_puts_them():
    """The host path checks only values near an edge: put values on every edge and one
    float32 step either side, at ranges small against their magnitude."""
    g = torch.Generator().manual_seed(2)
    for centre, width in ((0.0, 1.0), (5.0, 1e-3), (-300.0, 0.5), (1e-3, 1e-6)):
        x = torch.rand(5_000, generator=g) * width + centre
        edges, _ = histogram(x, 64)
        e = edges.numpy()
        probe = np.concatenate([e, np.nextafter(e, np.inf), np.nextafter(e, -np.inf)])
        probe = probe[(probe >= e[0]) & (probe <= e[-1])].astype(np.float32)
        y = torch.cat([x, torch.from_numpy(probe)])
        edges, counts = histogram(y, 64)
        ref, _ = np.histogram(y.numpy(), bins=edges.numpy())
        np.testing.assert_array_equal(counts.numpy(), ref)


def test_layer_histograms_cover_every_weight_of_the_layer(tiny):
    model, _, _ = tiny
    layers = Layers.of(model)
    edges, counts = layer_histograms(layers, bins=32)
    assert edges.shape == (len(layers), 33) and counts.shape == (len(layers), 32)
    i = layers.names.index("blocks.1.mlp.fc")
    fc = model.blocks[1].mlp.fc
    values = torch.cat([fc.weight.flatten(), fc.bias.flatten()]).detach().numpy()
    ref, _ = np.histogram(values, bins=edges[i].numpy())
    np.testing.assert_array_equal(counts[i].numpy(), ref)


def test_update_ratio_is_relative_change_per_layer(tiny):
    model, _, _ = tiny
    layers = Layers.of(model)
    before = snapshot(layers)
    with torch.no_grad():
        model.head.weight.mul_(1.1)  # a 10% change of this layer only
    expected = torch.tensor(0.1)  # ‖ΔW‖ / ‖W before‖: cs231n's ratio
    ratios = update_ratios(layers, before)  # consumes the snapshot
    i = layers.names.index("head")
    assert torch.allclose(ratios[i], expected, rtol=1e-4)
    others = torch.cat([ratios[:i], ratios[i + 1:]])
    assert torch.all(others == 0)


def test_a_layer_of_zeros_has_no_update_ratio(tiny):
    """A fresh LoRA `B` is all zeros: ‖ΔW‖ / ‖W before‖ is undefined, NaN (it read 1.0
    with ‖W after‖ below, and a huge number over the 1e-12 floor of a zero denominator)."""
    model, _, _ = tiny
    with torch.no_grad():
        model.head.weight.zero_()
        if model.head.bias is not None:
            model.head.bias.zero_()
    layers = Layers.of(model)
    before = snapshot(layers)
    with torch.no_grad():
        model.head.weight.add_(0.01)
    ratios = update_ratios(layers, before)
    assert torch.isnan(ratios[layers.names.index("head")])
