import math

import pytest
import torch

import nbwatch
from nbwatch.probes.grads import Layers, clip_, layer_norms, param_grad_norms
from tests.conftest import tiny_step


def grad_norms(layers):
    """(global, per-layer, grads) the way the recorder takes them: device norms, one host
    copy, layers summed on the host."""
    norms, layer_of, grads = param_grad_norms(layers)
    total, per_layer = layer_norms([float(n) for n in norms], layer_of, len(layers))
    per_layer = [math.nan if v is None else v for v in per_layer]  # None: no gradient
    return torch.tensor(total), torch.tensor(per_layer), grads


def backward(model, batches):
    out = tiny_step(model, batches[0])
    from nbwatch import masked_cross_entropy

    masked_cross_entropy(out["logits"], out["labels"], out["mask"]).backward()


def test_layers_are_owning_module_paths_in_model_order(tiny):
    model, _, _ = tiny
    layers = Layers.of(model)
    assert layers.names[:4] == ("tok_emb", "pos_emb", "blocks.0.ln1", "blocks.0.attn.qkv")
    assert layers.names[-1] == "head"
    assert len(layers.params) == sum(1 for p in model.parameters() if p.requires_grad)


def test_a_wrapped_model_names_its_layers_as_the_model_alone_does(tiny):
    """Under torchrun a loop wraps the model in DistributedDataParallel (DataParallel
    here: the same `module.` prefix, no process group); torch.compile in `_orig_mod.`.
    The layers keep the model's own names, so a run compares with one trained alone."""
    model, _, _ = tiny
    alone = Layers.of(model)
    for wrapped in (torch.nn.DataParallel(model), torch.compile(model)):
        got = Layers.of(wrapped)
        assert got.names == alone.names, got.names[:3]
        assert got.params == alone.params and got.layer_of == alone.layer_of


def test_layer_norms_square_sum_to_global_norm_equal_to_torch(tiny):
    model, _, batches = tiny
    backward(model, batches)
    layers = Layers.of(model)
    total, per_layer, _ = grad_norms(layers)
    assert torch.allclose(per_layer.square().sum(), total.square(), rtol=1e-5)
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert torch.allclose(total, expected, rtol=1e-5)
    # each layer's norm is the norm of its own parameters' gradients
    qkv = model.blocks[0].attn.qkv
    manual = torch.cat([qkv.weight.grad.flatten(), qkv.bias.grad.flatten()]).norm()
    i = layers.names.index("blocks.0.attn.qkv")
    assert torch.allclose(per_layer[i], manual, rtol=1e-5)


def test_a_layer_without_grads_has_no_norm_and_adds_nothing(tiny):
    model, _, batches = tiny
    model.head.weight.requires_grad_(False)
    layers = Layers.of(model)
    assert "head" not in layers.names
    backward(model, batches)
    model.pos_emb.weight.grad = None
    total, per_layer, grads = grad_norms(layers)
    assert math.isnan(per_layer[layers.names.index("pos_emb")])
    assert len(grads) == len(layers.params) - 1
    assert float(total) == pytest.approx(math.sqrt(sum(float(g.norm()) ** 2 for g in grads)),
                                         rel=1e-5)
    # a gradient of zeros is a norm of zero, not a missing one
    model.pos_emb.weight.grad = torch.zeros_like(model.pos_emb.weight)
    _, per_layer, _ = grad_norms(layers)
    assert per_layer[layers.names.index("pos_emb")] == 0


def test_clip_bounds_the_norm_like_torch(tiny):
    model, _, batches = tiny
    backward(model, batches)
    layers = Layers.of(model)
    reference = [p.grad.clone() for p in layers.params]
    total, _, grads = grad_norms(layers)
    max_norm = float(total) / 4
    after = clip_(grads, float(total), max_norm)
    assert after <= max_norm * (1 + 1e-5)
    recomputed = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    assert float(recomputed) == pytest.approx(after, rel=1e-5)
    for p, r in zip(layers.params, reference):  # same result as torch's own clipping
        p.grad = r
    torch.nn.utils.clip_grad_norm_(layers.params, max_norm)
    for p, g in zip(layers.params, grads):
        assert torch.allclose(p.grad, g, rtol=1e-5, atol=1e-8)


def test_clip_leaves_small_gradients_alone(tiny):
    model, _, batches = tiny
    backward(model, batches)
    layers = Layers.of(model)
    total, _, grads = grad_norms(layers)
    before = [g.clone() for g in grads]
    after = clip_(grads, float(total), float(total) * 10)
    assert after == pytest.approx(float(total))
    assert all(torch.equal(a, b) for a, b in zip(before, grads))


@pytest.mark.parametrize("gpu_order", [False, True])
def test_a_sparse_gradient_is_measured_and_clipped_not_a_crash(tmp_path, monkeypatch,
                                                               gpu_order):
    """`nn.Embedding(sparse=True)` beside a dense layer, SGD: the norms are those of the
    gradients' coalesced values (the loop's own figure), nbwatch's clip holds, and the
    run trains to its end (it used to fail inside `optimizer.step()`)."""
    from nbwatch.recorder import host_copy

    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False, clip=0.05) as mon:
        for _ in range(6):
            loss = model(torch.randint(0, 50, (4, 6))).pow(2).mean()
            loss.backward()
            grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad
                     for p in model.parameters()]
            mine.append(float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g) for g in grads]))))
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
    df = nbwatch.open_run(tmp_path / "r").df
    assert df.index.tolist() == list(range(1, 7))
    assert df["grad_norm/global"].tolist() == pytest.approx(mine, rel=1e-5)
    assert (df["grad_norm/clipped"] <= 0.05 + 1e-6).all() and max(mine) > 0.05


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
@pytest.mark.parametrize("gpu_order", [False, True])
def test_a_float64_or_complex_model_is_measured_and_clipped_not_a_crash(
        tmp_path, monkeypatch, gpu_order, dtype):
    """A float64 model (and one with complex weights) beside a float32 layer: the norms
    are torch's own `clip_grad_norm_`'s, the clip holds, the run ends (it failed inside
    `optimizer.step()`: a float32 norm refuses to narrow float64)."""
    from nbwatch.recorder import host_copy

    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8, dtype=dtype), torch.nn.Linear(8, 1))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8, dtype=dtype), torch.nn.Linear(8, 1))
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))

    def loss_of(m, x):
        return m[1](m[0](x.to(dtype)).abs().float()).pow(2).mean()

    mine = []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False, clip=0.05,
                         update_every=1, hist_every=4) as mon:
        for _ in range(4):
            x = torch.randn(3, 4)
            loss_of(ref, x).backward()
            mine.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
            ref_opt.step()
            ref_opt.zero_grad()
            loss = loss_of(model, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
    df = nbwatch.open_run(tmp_path / "r").df
    assert df["grad_norm/global"].tolist() == pytest.approx(mine, rel=1e-5)
    assert (df["grad_norm/clipped"] <= 0.05 + 1e-6).all() and min(mine) > 0.05
    assert df["update_ratio/0"].notna().all()
    # a complex weight's histogram holds its real and imaginary parts
    steps, edges, counts = nbwatch.open_run(tmp_path / "r").histograms("weight/0")
    w = torch.cat([p.detach().reshape(-1) for p in model[0].parameters()])
    parts = torch.view_as_real(w).reshape(-1) if w.is_complex() else w
    assert steps[-1] == 4 and counts[-1].sum() == parts.numel()
    assert edges[-1][0] == pytest.approx(parts.min().item(), rel=1e-6)
    assert edges[-1][-1] == pytest.approx(parts.max().item(), rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
