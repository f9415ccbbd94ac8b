"""MFU: model FLOPs per token (PaLM appendix B), the model's shape read from real models,
the peak table by device name, and a real run that records TFLOP/s (and MFU with a peak)."""

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT, make_demo
from nbwatch.probes.throughput import (
    ENCODER_DECODER,
    Mfu,
    flops_per_token,
    model_shape,
    peak_flops,
)


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


class _InlineBlock(torch.nn.Module):
    """A pre-norm block that calls F.scaled_dot_product_attention itself, from a fused qkv
    Linear: no module of its own named attn or attention."""

    def __init__(self, d: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(self.ln(x)).split(c, -1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Mixer(torch.nn.Module):  # mamba_ssm's name for its blocks' state-space mixer
    def __init__(self, d: int = 32):
        super().__init__()
        self.in_proj = torch.nn.Linear(d, 2 * d)


class Mamba(_Mixer):
    pass


def test_a_config_of_ones_own_keeps_its_attention_term_unless_it_has_no_attention():
    """A Transformer of one's own whose config gives its layer count (nanoGPT's, litgpt's
    `config.n_layer`) and whose blocks call F.scaled_dot_product_attention from modules
    not named attn or attention keeps its 12·L·T·d (it lost it: ~13% of GPT-2 small's
    FLOPs at 1,024 tokens); a model known to have none drops it: a Hugging Face Mamba,
    mamba_ssm's (its mixers' class), an LSTM LM."""
    from types import SimpleNamespace

    class Own(torch.nn.Module):
        def __init__(self, blocks):
            super().__init__()
            self.config = SimpleNamespace(n_layer=2, n_embd=32, block_size=16)
            self.wte = torch.nn.Embedding(50, 32)
            self.blocks = torch.nn.ModuleList(blocks)
            self.head = torch.nn.Linear(32, 50)

    assert model_shape(Own([_InlineBlock(), _InlineBlock()]))[1:] == (2, 32, None)
    assert model_shape(Own([Mamba(), Mamba()]))[1] == 0
    assert model_shape(Own([torch.nn.LSTM(32, 32), torch.nn.LSTM(32, 32)]))[1] == 0
    tf = pytest.importorskip("transformers")
    hf = tf.MambaForCausalLM(tf.MambaConfig(num_hidden_layers=2, hidden_size=32,
                                            vocab_size=50))
    assert model_shape(hf)[1] == 0


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


def test_peft_modules_to_save_count_the_copy_that_runs_not_the_original():
    """PEFT's `modules_to_save` trains a copy of a module beside LoRA, in a wrapper whose
    forward calls the copy: the frozen original runs no matmul, and a trained copy of an
    embedding is still only looked up. N counted the original lm_head beside its copy
    (the wrapper's `weight` reads the copy's), and a trained embedding copy as a matmul
    weight, 4·N + 2·N_trained too high by 4·V·d, 6·V·d where both are saved."""
    peft = pytest.importorskip("peft")
    tf = pytest.importorskip("transformers")

    def lora(**kw):
        torch.manual_seed(0)
        base = tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
        return peft.get_peft_model(base, peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], **kw))

    plain = Mfu.of(lora(), peak=None)
    lora_n, vd = 2 * 2 * (8 * 64 + 64 * 8), 256 * 64
    assert plain.n_trained == lora_n
    head = Mfu.of(lora(modules_to_save=["lm_head"]), peak=None)
    assert (head.n, head.n_trained) == (plain.n, lora_n + vd)  # the copy in, trained
    both = Mfu.of(lora(modules_to_save=["embed_tokens", "lm_head"]), peak=None)
    assert (both.n, both.n_trained) == (plain.n, lora_n + vd)  # the table looked up
    off = lora(modules_to_save=["lm_head"])
    with off.disable_adapter():  # the original runs: it is counted, the copy is not
        assert Mfu.of(off, peak=None).n == plain.n


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


def test_a_routed_expert_counts_top_k_of_its_experts_per_token():
    """Mixtral top-1 of 8: a token's matmuls use one expert's weights, not all eight
    (counting them all overstated TFLOP/s and MFU 4.7× on this model)."""
    tf = pytest.importorskip("transformers")
    cfg = tf.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                           num_local_experts=8, num_experts_per_tok=1)
    model = tf.MixtralForCausalLM(cfg)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    lookups = model.model.embed_tokens.weight.numel()
    n, *_ = model_shape(model)
    assert n == sum(p.numel() for p in model.parameters()) - lookups - experts * 7 / 8
    mfu = Mfu.of(model, peak=None)
    assert (mfu.n, mfu.n_trained, mfu.unknown_experts) == (n, n, [])


class _Moe(torch.nn.Module):  # a hand-written top-1 MoE: one expert per token
    def __init__(self, top_k=None):
        super().__init__()
        self.router = torch.nn.Linear(8, 4)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        if top_k is not None:
            self.top_k = top_k

    def forward(self, x):
        idx = self.router(x).argmax(-1)
        return torch.stack([self.experts[int(i)](r) for r, i in zip(x, idx)])


def test_a_hand_written_moe_says_when_its_top_k_is_unknown(tmp_path):
    told = _Moe(top_k=1)
    one = sum(p.numel() for p in told.experts[0].parameters())
    assert model_shape(told)[0] == sum(p.numel() for p in told.router.parameters()) + one
    model = _Moe()
    assert model_shape(model)[0] == sum(p.numel() for p in model.parameters())
    # said at the first step with tokens/s (a mask's 32 tokens a step), where TFLOP/s begin;
    # a run of bare tensors (no tokens, no TFLOP/s) says nothing of them
    batch = {"x": torch.randn(4, 8), "attention_mask": torch.ones(4, 8, dtype=torch.long)}
    for name, batches in (("tokens", [batch] * 3), ("tensors", [torch.randn(4, 8)] * 3)):
        mon = nbwatch.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              run_dir=tmp_path / name, display=False)
        mon.start(lambda m, b: m(b["x"] if isinstance(b, dict) else b).square().mean(),
                  batches, max_steps=3, display=False).wait()
        said = mon.events[mon.events.message.str.contains("upper bounds")]
        if name == "tensors":
            assert said.empty and "throughput/tflops" not in mon.df
            continue
        assert len(said) == 1 and "experts" in said.message.iloc[0]
        assert "top_k" in said.message.iloc[0]
        assert said.step.iloc[0] == mon.df["throughput/tflops"].first_valid_index()


def test_an_encoder_decoders_figures_are_said_to_be_estimates(tmp_path):
    """A T5's encoder and decoder see different tokens, which one tokens/s cannot tell:
    the run says once that its TFLOP/s and MFU are estimates; a decoder-only says nothing."""
    tf = pytest.importorskip("transformers")
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, decoder_start_token_id=0, pad_token_id=0))
    assert Mfu.of(t5, peak=None).notes == [ENCODER_DECODER]
    gpt = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    assert Mfu.of(gpt, peak=None).notes == []
    opt = torch.optim.AdamW(t5.parameters(), lr=1e-3)

    def step(model, batch):
        ids = batch["input_ids"]
        return {"logits": model(input_ids=ids, labels=ids).logits, "labels": ids}

    mon = nbwatch.Monitor(t5, opt, run_dir=tmp_path / "t5", display=False)
    batch = {"input_ids": torch.randint(2, 32, (2, 6)), "attention_mask": torch.ones(2, 6)}
    mon.start(step, [batch] * 2, max_steps=2)
    mon.wait()
    said = mon.events[mon.events.message == ENCODER_DECODER]
    assert len(said) == 1 and "tokens/real" in mon.df
    # at the step whose TFLOP/s it speaks of: the first with tokens/s
    assert said.step.iloc[0] == mon.df["throughput/tflops"].first_valid_index()


# -- samples: one count (`batch_samples`) in every loop -----------------------------------


def test_batch_samples_counts_the_rows_of_the_first_batched_tensor():
    """Unit: a Mapping's (a dict's, a BatchEncoding's, a UserDict's), a tuple's or a
    list's first tensor with rows; 0-dim tensors and numbers skipped; nested containers
    only where no tensor of the batch's own has rows; a lone 1-D input_ids one sequence."""
    from collections import UserDict

    from nbwatch.probes.throughput import batch_samples, mask_rows

    x, ids = torch.randn(3, 4), torch.ones(3, 5, dtype=torch.long)
    assert batch_samples(x) == 3 and batch_samples(torch.tensor(2.0)) is None
    assert batch_samples(torch.arange(6)) == 6  # a loader of scalars or indices: 6 of them
    assert batch_samples(UserDict(input_ids=ids)) == 3
    assert batch_samples({"scale": torch.tensor(0.5), "lr": 1e-3, "x": x}) == 3
    assert batch_samples((torch.tensor(1), x, torch.randn(3))) == 3
    assert batch_samples({"step": torch.tensor(0), "inputs": {"x": x}, "y": [x[:2]]}) == 3
    assert batch_samples({"inputs": {"x": x}, "y": torch.zeros(5)}) == 5  # its own first
    assert batch_samples({"labels": torch.tensor([0, 1, 1]), "input_ids": ids}) == 3
    assert batch_samples({"input_ids": torch.ones(7, dtype=torch.long)}) == 1  # [T]
    assert batch_samples({"input_ids": ids[0], "attention_mask": ids[0], "labels": ids[0]}) == 1
    assert batch_samples({"scale": torch.tensor(1.0), "lr": 0.1}) is None
    assert batch_samples(None) is None and batch_samples([]) is None
    assert mask_rows([ids, ids[0]]) == 4  # a [T] mask: one sequence


def _sample_cases():
    """(micro-batches, hand count of samples, tokens/real or None) a step: a filler (a
    loop of one's own times no first step), a BatchEncoding, a dict led by a 0-dim
    tensor, a nested dict, an (x, y) pair, B labels beside [B, T] input_ids, one
    sequence's [T] input_ids."""
    tf = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)

    def ids(*shape):
        return torch.randint(1, 50, shape, generator=g)

    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    return [
        ((torch.randn(6, 4, generator=g), torch.randn(6, generator=g)), 6, None),
        (tf.BatchEncoding({"input_ids": ids(3, 5), "attention_mask": mask}), 3, 10),
        ({"scale": torch.tensor(0.5), "x": torch.randn(4, 4, generator=g)}, 4, None),
        ({"step": torch.tensor(3), "inputs": {"x": torch.randn(2, 4, generator=g)},
          "targets": {"y": torch.randn(2, generator=g)}}, 2, None),
        ((torch.randn(5, 4, generator=g), torch.randn(5, generator=g)), 5, None),
        ({"labels": torch.tensor([0, 1, 1]), "input_ids": ids(3, 4)}, 3, 12),
        ({"input_ids": ids(7)}, 1, 7),
    ]


def _counted(df):
    """Each step's samples, from samples/s and its time (None for a step with no time)."""
    return [None if r * t != r * t else round(r * t) for r, t in
            zip(df["throughput/samples_per_s"], df["time/step"], strict=True)]


def _tokens(df):
    tokens = df["tokens/real"] if "tokens/real" in df else [float("nan")] * len(df)
    return [None if t != t else int(t) for t in tokens]


def _loss(net, batch):
    return net.weight.square().sum()  # a shape of any batch: its samples are what counts


def _in_loop(tmp_path, loop: str, batches: list, micro: int = 1, **kw) -> object:
    """`batches` (`micro` a step) through `loop`: start(), log(batch=...) (a list of the
    step's micro-batches where it has several), the Trainer (nbwatch.hf.NbwatchCallback,
    its batches in order), Lightning; the run's figures. `kw`: the run's options."""
    torch.manual_seed(0)
    net, run_dir = torch.nn.Linear(4, 1), tmp_path / loop
    steps = len(batches) // micro
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    if loop == "start":
        mon = nbwatch.Monitor(net, opt, run_dir=run_dir, display=False, **kw)
        mon.start(_loss, batches, max_steps=steps, accumulate=micro, display=False).wait()
        assert mon.state == "finished", mon.error
    elif loop == "log":
        with nbwatch.Monitor(net, opt, run_dir=run_dir, display=False, **kw) as mon:
            for i in range(0, len(batches), micro):
                losses = [_loss(net, b) / micro for b in batches[i:i + micro]]
                for one in losses:
                    one.backward()
                opt.step()
                opt.zero_grad()
                mon.log(losses if micro > 1 else losses[0],
                        batch=batches[i:i + micro] if micro > 1 else batches[i])
    elif loop == "hf":
        tf = pytest.importorskip("transformers")
        from nbwatch.hf import NbwatchCallback

        class Trainer(tf.Trainer):
            def compute_loss(self, model, inputs, *a, **k):
                return _loss(model, inputs)

            def _get_train_sampler(self, *a, **k):
                return torch.utils.data.SequentialSampler(batches)

        Trainer(model=net, train_dataset=batches, data_collator=lambda items: items[0],
                callbacks=[NbwatchCallback(run_dir=run_dir, display=False, **kw)],
                args=tf.TrainingArguments(
                    output_dir=str(tmp_path / "out"), max_steps=steps, report_to=[],
                    per_device_train_batch_size=1, gradient_accumulation_steps=micro,
                    remove_unused_columns=False, save_strategy="no", use_cpu=True,
                    disable_tqdm=True, log_level="error")).train()
    else:
        from tests.conftest import lightning_fit

        lightning_fit(tmp_path, net, _loss, batches, run_dir, max_steps=steps,
                      accumulate_grad_batches=micro, **kw)
    return nbwatch.open_run(run_dir).df


@pytest.mark.parametrize("loop", ["start", "log", "hf", "lightning"])
def test_every_loop_counts_a_batchs_samples_by_hand(tmp_path, loop):
    """A step's samples (samples/s × its time) are its batch's rows in every loop: a
    BatchEncoding's (start() counted none: not a dict), a dict's first batched tensor's
    past a leading 0-dim one (start() counted 1), a nested dict's (the others counted
    none), an (x, y) pair's, [B, T] input_ids' beside B labels; one sequence's [T]
    input_ids is one sample of T tokens (T samples, and no tokens without a mask)."""
    cases = _sample_cases()
    df = _in_loop(tmp_path, loop, [b for b, _, _ in cases])
    want = [n for _, n, _ in cases]
    if loop == "log":
        want[0] = None  # its first step has no time
    assert _counted(df) == want
    assert _tokens(df) == [t for _, _, t in cases]


@pytest.mark.parametrize("loop", ["start", "log", "hf", "lightning"])
def test_every_loop_adds_up_its_micro_batches_samples(tmp_path, loop):
    """Two micro-batches a step, of 3 and 2 rows: 5 samples (a loop of one's own given
    the list of the step's batches)."""
    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(n, 4, generator=g)} for n in (3, 2, 3, 2, 3, 2)]
    df = _in_loop(tmp_path, loop, batches, micro=2)
    assert _counted(df) == [None if loop == "log" else 5, 5, 5]


# -- a batch in parts (`loader_batches`) --------------------------------------------------


def _parts_cases():
    """(a step's batch in parts, hand counts: samples (the batch's own rows: the first
    part's), every sequence's length or None, positions): a dict of dict batches (a
    pair's chosen and rejected), a list of them, a dict of `[x, y]` parts, one part None,
    a packed part beside a padded one (its documents and rows), text beside `(x, y)`;
    then two batches that are not in parts: a dict with a batched tensor of its own
    beside a nested dict, a list of `(x, y)` pairs (two views)."""
    g = torch.Generator().manual_seed(0)

    def ids(*shape):
        return torch.randint(1, 50, shape, generator=g)

    def mask(*rows):
        return torch.tensor(rows)

    return [
        ({"chosen": {"input_ids": ids(3, 5),
                     "attention_mask": mask([1] * 5, [1, 1, 1, 0, 0], [1, 1, 0, 0, 0])},
          "rejected": {"input_ids": ids(3, 4),
                       "attention_mask": mask([1] * 4, [1, 1, 0, 0], [1, 0, 0, 0])}},
         3, [5, 3, 2, 4, 2, 1], 15 + 12),
        ([{"input_ids": ids(2, 6), "attention_mask": mask([1] * 6, [1, 1, 1, 1, 0, 0])},
          {"input_ids": ids(2, 3)}],  # no mask: every token real
         2, [6, 4, 3, 3], 12 + 6),
        ({"a": [torch.randn(4, 4, generator=g), torch.randn(4, generator=g)],
          "b": [torch.randn(4, 4, generator=g), torch.randn(4, generator=g)]}, 4, None, None),
        ({"a": None, "b": {"input_ids": ids(2, 3), "attention_mask": mask([1, 1, 1], [1, 0, 0])}},
         2, [3, 1], 6),
        ({"a": {"input_ids": ids(1, 8), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])},
          "b": {"input_ids": ids(2, 4), "attention_mask": mask([1, 1, 1, 0], [1] * 4)}},
         3 + 2, [3, 2, 3, 3, 4], 8 + 8),  # 3 documents and 2 rows
        ({"text": {"input_ids": ids(2, 3), "attention_mask": mask([1, 1, 0], [1, 1, 1])},
          "target": [torch.randn(2, 4, generator=g), torch.randn(2, generator=g)]},
         2, [2, 3], 6),  # text beside (x, y): the text's tokens, the batch's rows
        ({"x": torch.randn(3, 4, generator=g), "extra": {"input_ids": ids(5, 2)}}, 3, None, None),
        ([(torch.randn(2, 4, generator=g), torch.randn(2, generator=g)),
          (torch.randn(2, 4, generator=g), torch.randn(2, generator=g))], 2, None, None),
    ]


@pytest.mark.parametrize("loop", ["start", "log", "hf", "lightning"])
def test_every_loop_counts_a_batch_in_parts_by_hand(tmp_path, loop):
    """A step whose batch comes in parts with no batched tensor of its own (a pair's
    chosen and rejected, `{"image": ..., "text": ...}`, `(inputs, labels)` dicts): each
    part's tokens (its attention_mask, else every input_ids token), data/seq_len_mean and
    _max over every sequence, the padding over every position and the data/seq_len
    histogram every length; its samples its own rows, not the parts' added up (a pair
    counted twice). The dicts' tokens were not counted at all. A dict with a batched
    tensor of its own and a list of (x, y) pairs after one backward pass are one batch."""
    cases = _parts_cases()
    df = _in_loop(tmp_path, loop, [b for b, *_ in cases], hist_every=1)
    want = [n for _, n, _, _ in cases]
    if loop == "log":
        want[0] = None  # its first step has no time
        want[1] = 2 + 2  # log(batch=[b1, b2]): a list of dict batches is the micro-batches
    assert _counted(df) == want
    lengths = [ls for _, _, ls, _ in cases]
    assert _tokens(df) == [None if ls is None else sum(ls) for ls in lengths]
    for step, (_, _, ls, width) in enumerate(cases, start=1):
        row = df.loc[step]
        if ls is None:
            assert row.get("data/seq_len_mean") != row.get("data/seq_len_mean")  # NaN: none
            continue
        assert row["data/seq_len_mean"] == pytest.approx(sum(ls) / len(ls))
        assert row["data/seq_len_max"] == max(ls)
        assert row["data/padding_ratio"] == pytest.approx(1 - sum(ls) / width)
    at, edges, counts = nbwatch.open_run(tmp_path / loop).histograms("data/seq_len")
    steps = [s for s, (_, _, ls, _) in enumerate(cases, start=1) if ls is not None]
    assert at.tolist() == steps
    for e, c, s in zip(edges, counts, steps, strict=True):
        ls = cases[s - 1][2]
        assert c.sum() == len(ls) and (np.histogram(ls, bins=e)[0] == c).all()


@pytest.mark.parametrize("loop", ["start", "log", "hf", "lightning"])
def test_every_loop_adds_up_its_micro_batches_in_parts(tmp_path, loop):
    """Two micro-batches a step, each in two parts (3 rows, then 1): the step's samples
    are the micro-batches' rows (4), its tokens all four parts' (a loop of one's own
    given the list of the step's batches)."""
    def two(n):
        return {"a": {"input_ids": torch.ones(n, 4, dtype=torch.long),
                      "attention_mask": torch.tensor([[1, 1, 0, 0]] * n)},
                "b": {"input_ids": torch.ones(n, 3, dtype=torch.long)}}

    df = _in_loop(tmp_path, loop, [two(3), two(1)] * 2, micro=2)
    assert _counted(df) == [None if loop == "log" else 4, 4]
    assert _tokens(df) == [(3 + 1) * (2 + 3)] * 2
    assert df["data/seq_len_max"].tolist() == [3, 3]
    assert df["data/seq_len_mean"].tolist() == pytest.approx([20 / 8] * 2)


@pytest.mark.parametrize("loop", ["start", "log", "hf", "lightning"])
def test_a_micro_batch_of_no_tokens_beside_a_packed_one_adds_its_rows(tmp_path, loop):
    """Two micro-batches a step: a packed one (3 documents) and one of pixels (5 rows), in
    either order: 8 samples in every loop; start(accumulate=2) counted the documents alone
    (3), the pixels' rows dropped, where log(batch=[...]), the Trainer and Lightning count
    8. The sequence figures stay the documents'."""
    packed = {"input_ids": torch.ones(1, 9, dtype=torch.long),
              "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])}
    pixels = {"pixel_values": torch.randn(5, 4, generator=torch.Generator().manual_seed(0))}
    df = _in_loop(tmp_path, loop, [packed, pixels, pixels, packed], micro=2)
    assert _counted(df) == [None if loop == "log" else 8, 8]
    assert _tokens(df) == [9, 9]
    assert df["data/seq_len_mean"].tolist() == pytest.approx([3.0, 3.0])


@pytest.mark.parametrize("loop", ["start", "log", "hf", "lightning"])
def test_a_batch_in_parts_beside_a_packed_micro_batch_counts_its_own_rows(tmp_path, loop):
    """Two micro-batches a step: a packed one (3 documents) and a pair's chosen and
    rejected (2 rows): 3 + 2 samples; the documents' step counted both parts' rows (7),
    as it counts a padded micro-batch's rows beside them."""
    def tok(width):
        return {"input_ids": torch.ones(2, width, dtype=torch.long),
                "attention_mask": torch.ones(2, width, dtype=torch.long)}

    packed = {"input_ids": torch.ones(1, 9, dtype=torch.long),
              "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])}
    pair = {"chosen": tok(5), "rejected": tok(4)}
    df = _in_loop(tmp_path, loop, [packed, pair, pair, packed], micro=2)
    assert _counted(df) == [None if loop == "log" else 5, 5]
    assert _tokens(df) == [9 + 18] * 2


def test_start_counts_a_batchs_rows_as_the_loader_gave_it(tmp_path):
    """A step_fn that takes its tensors out of its dict batch (`x, y = batch.pop("x"),
    batch.pop("y")`, as a compute_loss pops its labels) leaves it empty by the time the
    step's figures are taken: start() counts the rows the batch came with, 3 a step, and
    samples/s is there (it went missing when the rows were counted after the step_fn)."""
    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(3, 4, generator=g), "y": torch.randn(3, generator=g)}
               for _ in range(3)]

    def step_fn(net, batch):
        x, y = batch.pop("x"), batch.pop("y")
        return (net(x).squeeze(-1) - y).square().mean()

    net = torch.nn.Linear(4, 1)
    mon = nbwatch.Monitor(net, torch.optim.SGD(net.parameters(), lr=1e-3),
                          run_dir=tmp_path / "run", display=False)
    mon.start(step_fn, batches, max_steps=3, display=False).wait()
    assert mon.state == "finished", mon.error
    assert _counted(nbwatch.open_run(tmp_path / "run").df) == [3, 3, 3]


def test_a_vit_counts_its_patches_and_class_token_for_each_image(tmp_path):
    """A ViT's batch of pixels has no tokens, but its encoder sees 17 positions an image
    (16 patches of 8 at 32 px, and the class token): TFLOP/s is samples/s × 17 ×
    (6·N + 12·L·17·d), N without the position table and class token (added, in no
    matmul), said once how it is counted."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.ViTForImageClassification(tf.ViTConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        image_size=32, patch_size=8, num_labels=4))
    n = sum(p.numel() for name, p in model.named_parameters()
            if not name.endswith(("position_embeddings", "cls_token")))
    mfu = Mfu.of(model, peak=None)
    assert (mfu.image_tokens, mfu.n, mfu.n_trained) == (17, n, n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [{"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 4, (4,))}
               for _ in range(3)]
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "vit", display=False, peak_flops=1e12)
    mon.start(lambda m, b: m(**b).loss, batches, max_steps=3).wait()
    df = mon.df
    per_image = 17 * (6 * n + 12 * 2 * 17 * 16)
    by_hand = df["throughput/samples_per_s"] * per_image
    np.testing.assert_allclose(df["throughput/tflops"] * 1e12, by_hand, rtol=1e-6)
    np.testing.assert_allclose(df["throughput/mfu"] * 1e12, by_hand, rtol=1e-6)
    assert "tokens/real" not in df  # pixels are still no tokens
    said = mon.events[mon.events.message.str.contains("vision Transformer")]
    assert len(said) == 1 and "17 positions" in said.message.iloc[0]


def test_a_vit_whose_table_is_not_its_positions_counts_none():
    """Swin's absolute position table is its first stage's alone (windowed attention, its
    stages merging patches 4 to 1: L·T²·d over the table's 64 counted 4 times too many
    positions at its second stage, and attention over all of them); ViTMAE's encoder sees a
    quarter of the table's patches; Dinov2 resizes its table to every input (its Hub
    configs' 518 px table: 1,370 positions, where a fine-tune at 224 px sees 257, and its
    register tokens beside them): none is given image positions (no TFLOP/s, as any
    pixels)."""
    tf = pytest.importorskip("transformers")
    vit = dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
               image_size=32, patch_size=8)
    swin = tf.SwinForImageClassification(tf.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4, use_absolute_embeddings=True))
    mae = tf.ViTMAEForPreTraining(tf.ViTMAEConfig(
        **vit, decoder_num_hidden_layers=1, decoder_hidden_size=16,
        decoder_intermediate_size=32, decoder_num_attention_heads=2))
    assert Mfu.of(swin, None).image_tokens is None
    assert Mfu.of(mae, None).image_tokens is None
    reg = tf.Dinov2WithRegistersForImageClassification(tf.Dinov2WithRegistersConfig(
        **vit, num_register_tokens=4))
    assert Mfu.of(reg, None).image_tokens is None
    dino = tf.Dinov2ForImageClassification(tf.Dinov2Config(**vit))
    assert Mfu.of(dino, None).image_tokens is None
