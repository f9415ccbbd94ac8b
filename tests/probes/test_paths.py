"""A model wrapped for data parallelism names its modules as the model alone does: the
per-layer figures, the blocks, the output layer, the attention maps and the MFU's shape."""

import torch

from nbwatch.demo import TinyGPT
from nbwatch.probes.activations import blocks, output_layers
from nbwatch.probes.attention import capture_attention
from nbwatch.probes.grads import Layers
from nbwatch.probes.throughput import model_shape


def test_a_data_parallel_model_names_its_modules_as_the_model_alone_does():
    """DataParallel stands in for DistributedDataParallel here (the same `module.`
    prefix, no process group needed)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32).eval()
    wrapped = torch.nn.DataParallel(model)
    assert Layers.of(wrapped).names == Layers.of(model).names
    assert [p for p, _ in blocks(wrapped)] == [p for p, _ in blocks(model)] != []
    assert output_layers(wrapped) == output_layers(model) != []
    assert model_shape(wrapped) == model_shape(model)
    idx = torch.randint(1, 64, (2, 8))
    with capture_attention(wrapped) as maps:
        wrapped(idx)
    assert sorted(maps) == ["blocks.0.attn", "blocks.1.attn"]
