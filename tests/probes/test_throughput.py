"""MFU: model FLOPs per token (PaLM appendix B), the model's shape read from real models,
the peak table by device name, and a real run that records TFLOP/s (and MFU with a peak)."""

import pytest

import nbwatch
from nbwatch.demo import TinyGPT, make_demo
from nbwatch.probes.throughput import Mfu, flops_per_token, model_shape, peak_flops


def test_flops_per_token_is_palms_6n_plus_the_attention_term():
    # GPT-2 small at T = 1024: 6 · 124M + 12 · 12 layers · 1024 · 768
    assert flops_per_token(124_000_000, 12, 1024, 768) == 6 * 124e6 + 12 * 12 * 1024 * 768
    assert flops_per_token(1000, 0, 1024, 0) == 6000  # no attention term known: 6·N


def test_model_shape_counts_matmul_parameters_once_and_reads_the_stack():
    model = TinyGPT(vocab=96, d=32, layers=3, heads=2, ctx=40)
    n, layers, d, ctx = model_shape(model)
    lookups = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()  # not tied
    assert n == sum(p.numel() for p in model.parameters()) - lookups
    assert (layers, d, ctx) == (3, 32, 40)
    model.head.weight = model.tok_emb.weight  # tied: the output matmul uses it, once
    n_tied, *_ = model_shape(model)
    assert n_tied == sum(
        p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()


def test_model_shape_of_a_hugging_face_gpt2_comes_from_its_config():
    tf = pytest.importorskip("transformers")
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64,
                                             n_positions=48))
    n, layers, d, ctx = model_shape(model)
    wpe = model.transformer.wpe.weight.numel()  # wte is tied to lm_head: counted once
    assert n == sum(p.numel() for p in model.parameters()) - wpe
    assert (layers, d, ctx) == (2, 32, 48)


def test_frozen_weights_take_no_weight_gradient_flops():
    """LoRA, a frozen backbone: a frozen weight's matmuls run forward (2·N) and pass the
    gradient on (2·N), but compute no weight gradient; 6·N counted that too (1.45× on a
    LoRA'd Llama, where 1.7% of the weights train)."""
    assert flops_per_token(1000, 0, 64, 0, n_trained=100) == 4 * 1000 + 2 * 100
    model = TinyGPT(vocab=96, d=32, layers=2, heads=2, ctx=40)
    for p in model.parameters():
        p.requires_grad_(False)
    model.head.weight.requires_grad_(True)
    n, *_ = model_shape(model)
    mfu = Mfu.of(model, peak=None)
    assert (mfu.n, mfu.n_trained) == (n, model.head.weight.numel())
    values = {"throughput/tokens_per_s": 10.0}
    mfu(values)
    trained = model.head.weight.numel()
    assert values["throughput/tflops"] == pytest.approx(
        10 * (4 * n + 2 * trained + 12 * 2 * 40 * 32) / 1e12)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12), ("NVIDIA A10G", 70e12),
    ("NVIDIA GeForce RTX 4090", 165e12), ("Some New Accelerator", None),
])
def test_peak_by_device_name(name, peak):
    assert peak_flops(name) == peak


def test_the_attention_term_uses_the_steps_padded_length():
    mfu = Mfu(1000, 2, 16, ctx=64, peak=None)
    # 800 real tokens/s of 10 samples/s at 20% padding: 100 positions a sample
    values = {"throughput/tokens_per_s": 800.0, "throughput/samples_per_s": 10.0,
              "data/padding_ratio": 0.2}
    mfu(values)
    assert values["throughput/tflops"] == pytest.approx(800 * (6000 + 12 * 2 * 100 * 16) / 1e12)
    assert "throughput/mfu" not in values  # no peak: the achieved TFLOP/s alone
    mfu.peak = 1e6
    mfu(values := {"throughput/tokens_per_s": 10.0})  # no sample count: the context
    assert values["throughput/mfu"] == pytest.approx(10 * (6000 + 12 * 2 * 64 * 16) / 1e6)


def test_a_cpu_run_records_tflops_and_with_a_given_peak_mfu(tmp_path):
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, max_steps=20)
    with pytest.raises(ValueError, match="peak_flops"):
        nbwatch.Monitor(demo.model, demo.optimizer, run_dir=tmp_path / "x", peak_flops=-1)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r",
                          peak_flops=1e12)
    mon.start(demo.step_fn, demo.train, max_steps=20, display=False).wait()
    df = mon.df
    n, layers, d, ctx = model_shape(demo.model)
    assert nbwatch.open_run(tmp_path / "r").meta["run"]["flops"] == {
        "n_params": n, "layers": 2, "d_model": 32, "ctx": 32, "peak_flops": 1e12,
        "n_trained": n}
    tflops, mfu = df["throughput/tflops"], df["throughput/mfu"]
    assert (tflops > 0).all() and mfu.equals(tflops)  # peak 1 TFLOP/s: MFU = TFLOP/s
    lo = df["throughput/tokens_per_s"] * 6 * n / 1e12  # the attention term only adds
    assert (tflops > lo).all() and (tflops <= lo * (1 + 2 * layers * ctx * d / n) * 1.0001).all()
