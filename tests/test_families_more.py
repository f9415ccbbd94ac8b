"""More model families, each a tiny real model built from its config (no download) trained
under the loop its practitioners use: Mamba (no attention at all) in a loop of its own;
under the Trainer, CLIP (two towers, a contrastive loss, no LM head), Whisper (speech
features in, no input_ids), Qwen2-MoE (routed and shared experts) and ModernBERT (global
and sliding-window layers, sparse prediction).
Every figure is checked against one computed by hand from the same model and step: torch's
norms of the gradients before the clip (global and per layer), the model's own block
outputs, attention weights and logits, the parameter counts behind TFLOP/s."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

tf = pytest.importorskip("transformers")

import nbwatch  # noqa: E402
import nbwatch.hf  # noqa: E402
from nbwatch.panels import Feed  # noqa: E402
from nbwatch.store import RunReader  # noqa: E402
from tests.scripts.wide_run import Padded  # noqa: E402
from tests.test_families import make_trainer, probe_of, trainer_log  # noqa: E402

VOCAB = 64
NOT_LAYERS = ("grad_norm/global", "grad_norm/clipped")


def layers_of(model) -> dict[str, list[torch.nn.Parameter]]:
    """{layer: its trained parameters}: a layer is the module owning a parameter directly
    (a tied weight belongs to its first owner), named as nbwatch names it."""
    out: dict[str, list[torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for path, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.setdefault(path or "(root)", []).append(p)
    return out


def norms_now(layers) -> tuple[float, dict[str, float]]:
    """torch's global norm of the gradients now, and each layer's."""
    grads = [p.grad for ps in layers.values() for p in ps if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)), {
        k: float(torch.nn.utils.get_total_norm([p.grad for p in ps]))
        for k, ps in layers.items() if all(p.grad is not None for p in ps)}


def norms_before_the_clip(trainer) -> list[tuple[float, dict[str, float]]]:
    """Each step's norms, taken where the Trainer is about to clip (nbwatch measures there
    too, then calls this)."""
    got: list[tuple[float, dict[str, float]]] = []
    clip, layers = trainer._clip_grad_norm, layers_of(trainer.model)

    def measured(model):
        got.append(norms_now(layers))
        return clip(model)

    trainer._clip_grad_norm = measured
    return got


def assert_norms(df, hand) -> None:
    assert list(df.dropna(subset=["grad_norm/global"]).index) == list(range(1, len(hand) + 1))
    for step, (total, layers) in enumerate(hand, 1):
        assert df.loc[step, "grad_norm/global"] == pytest.approx(total, rel=1e-5)
        recorded = {c for c in df if c.startswith("grad_norm/") and c not in NOT_LAYERS
                    and np.isfinite(df.loc[step, c])}
        assert recorded == {f"grad_norm/{k}" for k in layers}, step
        for k, v in layers.items():
            assert df.loc[step, f"grad_norm/{k}"] == pytest.approx(v, rel=1e-5, abs=1e-12)


def eager_copy(model):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return ref.eval()


def training_forwards(model) -> list[tuple[torch.Tensor, dict]]:
    """(the output layer's logits, the model's keyword inputs) of each training forward."""
    seen: list[tuple[torch.Tensor, dict]] = []
    inputs: dict = {}

    def on_model(mod, args, kwargs):
        inputs.clear()
        inputs.update(kwargs)

    def on_head(mod, args, out):
        if mod.training and torch.is_grad_enabled():
            seen.append((out.detach().float().clone(), dict(inputs)))

    if model.get_output_embeddings() is not None:
        model.register_forward_pre_hook(on_model, with_kwargs=True)
        model.get_output_embeddings().register_forward_hook(on_head)
    return seen


def log_z(logits, real=None) -> tuple[float, float]:
    """Mean log Σ exp and max |logit| over the rows (64 or fewer: all) of the real ones."""
    rows = logits.reshape(-1, logits.shape[-1])
    if real is not None:
        rows = rows[real.reshape(-1).bool()]
    return float(torch.logsumexp(rows, -1).mean()), float(rows.abs().max())


def assert_logits_by_hand(df, forwards, real_of, first: int = 1) -> None:
    for step, (logits, inputs) in list(enumerate(forwards, 1))[first - 1:]:
        z, top = log_z(logits, real_of(inputs))
        assert df.loc[step, "train_logits/log_z"] == pytest.approx(z, rel=1e-5)
        assert df.loc[step, "train_logits/max_abs"] == pytest.approx(top, rel=1e-5)


def run_under_trainer(tmp_path, model, train, val, collator=None):
    """6 steps, an eval at the last; the norms, loss and LR checked; nothing warned."""
    trainer = make_trainer(tmp_path / "out", model, train, val)
    trainer.data_collator = collator or trainer.data_collator
    hand, forwards = norms_before_the_clip(trainer), training_forwards(model)
    handle = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    handle.wait()
    assert handle.state == "finished" and handle.step == 6
    run = nbwatch.open_run(tmp_path / "run")
    df = run.df
    assert_norms(df, hand)
    for key, ours in (("loss", "loss/train"), ("learning_rate", "lr")):
        assert df[ours].tolist() == pytest.approx(list(trainer_log(trainer, key).values()))
    assert set(run.events.severity) == {"info"}  # no alert, no warning
    logged = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").open()]
    assert logged and {line["level"] for line in logged} == {"info"}
    return run, df, forwards


# -- Mamba: no attention at all, in a loop of its own -------------------------------------


def mamba():
    torch.manual_seed(0)
    return tf.MambaForCausalLM(tf.MambaConfig(
        vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
        conv_kernel=4, pad_token_id=0))


def batches_of(data, n: int = 4) -> list[dict]:
    return [probe_of(torch.utils.data.Subset(data, range(i, i + n)), n)
            for i in range(0, len(data), n)]


@pytest.fixture(scope="module")
def mamba_run(tmp_path_factory):
    """8 steps with `log(loss, batch=)`, a val every 2 (so a probe pass each), and what
    the model gives at each of those evals by hand: its blocks' output RMS on the probe
    samples, the mean log Z and max |logit| of its logits there."""
    run_dir = tmp_path_factory.mktemp("mamba") / "run"
    model = mamba()
    batches = batches_of(Padded(32, 0, vocab=VOCAB, T=16, shortest=6))
    probe = probe_of(Padded(2, 1, vocab=VOCAB, T=16, shortest=6))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    layers, hand, evals = layers_of(model), [], {}
    blocks = [f"backbone.layers.{i}" for i in (0, 1)]
    with nbwatch.Monitor(model, opt, run_dir=run_dir, probe_batch=probe,
                         display=False) as mon:
        for step, batch in enumerate(batches, 1):
            loss = model(**batch).loss
            loss.backward()
            hand.append(norms_now(layers))
            opt.step()
            opt.zero_grad()
            if step % 2 == 0:  # the weights the probe pass in log() sees
                outs: dict[str, torch.Tensor] = {}
                hooks = [model.get_submodule(b).register_forward_hook(
                    lambda m, a, o, b=b, outs=outs: outs.__setitem__(b, o)) for b in blocks]
                model.eval()
                with torch.no_grad():
                    logits = model(**probe).logits.float()
                model.train()
                for h in hooks:
                    h.remove()
                evals[step] = {f"act/rms/{b}": float(outs[b].pow(2).mean().sqrt())
                               for b in blocks}
                evals[step]["logits/z_mean"] = float(torch.logsumexp(logits, -1).mean())
                evals[step]["logits/max_abs"] = float(logits.abs().max())
            mon.log(loss=loss, batch=batch, val=loss.item() if step % 2 == 0 else None)
    assert mon.state == "finished"
    return model, nbwatch.open_run(run_dir), hand, evals


def test_mamba_keeps_its_residual_stream_and_logits_figures_at_every_eval(mamba_run):
    """No attention anywhere: said once (info), no maps; the probe pass still takes the
    blocks' RMS and the output logits at every eval (it was switched off at the first,
    leaving one point of each), each equal to the model's own at that step."""
    model, run, hand, evals = mamba_run
    df = run.df
    assert_norms(df, hand)
    for key in evals[2]:
        assert list(df[key].dropna().index) == sorted(evals), key
        for step, figures in evals.items():
            assert df.loc[step, key] == pytest.approx(figures[key], rel=1e-5), (key, step)
    said = run.events.query("kind == 'probe'")
    assert len(said) == 1 and said.severity.iloc[0] == "info"
    msg = said.message.iloc[0]
    assert "no attention layer" in msg and "act/rms" in msg and "logits/" in msg
    assert run.attention() == {} and not [c for c in df if c.startswith("attn/")]
    # the Attention panel says why it has no map; the Health panel draws the blocks' RMS
    # and the probe's logits beside its note (not the one line of a probe switched off)
    feed = Feed(RunReader(run.run_dir))
    while feed.update() is not None and feed.more:
        pass
    panels = feed.full()
    assert panels["attention"] == {"note": msg}
    assert panels["health"]["notes"] == {"attention": msg}
    assert {"rms", "z", "max_abs", "train_z"} <= set(panels["health"])


def test_mamba_tflops_count_no_attention_term(mamba_run):
    """TFLOP/s per token is 6·N: every parameter a token's matmuls use (the embedding is
    the tied LM head), and no 12·L·T·d for an attention Mamba has not (it was counted from
    the config's layers: 6,144 of 39,072 FLOPs a token here)."""
    model, run, _, _ = mamba_run
    df = run.df.dropna(subset=["throughput/tflops"])
    assert list(df.index) == [3, 5, 7]  # a step with a val, and step 1, have no rates
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    n = sum(p.numel() for p in model.parameters())
    per_token = df["throughput/tflops"] * 1e12 / df["throughput/tokens_per_s"]
    assert per_token.tolist() == pytest.approx([6.0 * n] * len(df), rel=1e-5)


def test_mamba_under_start_weighs_its_logits_by_the_attention_mask(tmp_path):
    """start() with the README's Hugging Face step, `{"loss": out.loss}`: log Z of the
    logits the output layer gave (from step 2) is over the batch's real tokens, as under
    the Trainer and log(batch=) (it was over every position, padding too); norms by hand."""
    model = mamba()
    batches = batches_of(Padded(24, 0, vocab=VOCAB, T=16, shortest=6))
    assert all((b["attention_mask"] == 0).any() for b in batches)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    layers, hand = layers_of(model), []
    opt.register_step_pre_hook(lambda o, a, k: hand.append(norms_now(layers)))
    forwards = training_forwards(model)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", display=False)
    mon.start(lambda m, b: {"loss": m(**b).loss}, batches, max_steps=6).wait()
    assert mon.state == "finished"
    df = nbwatch.open_run(tmp_path / "run").df
    assert_norms(df, hand)
    assert_logits_by_hand(df, forwards, lambda inputs: inputs["attention_mask"], first=2)


# -- CLIP: two towers, a contrastive loss, no LM head, under the Trainer ------------------


def image_text(n: int, seed: int) -> list[dict]:
    """Captions of 4 to 10 tokens (EOS last, right-padded to 10) and 16×16 images."""
    g, items = torch.Generator().manual_seed(seed), []
    for _ in range(n):
        length = int(torch.randint(4, 11, (1,), generator=g))
        ids = torch.zeros(10, dtype=torch.long)
        ids[:length] = torch.randint(3, VOCAB, (length,), generator=g)
        ids[length - 1] = 2
        items.append({"input_ids": ids, "attention_mask": (ids != 0).long(),
                      "pixel_values": torch.randn(3, 16, 16, generator=g)})
    return items


def with_loss(items):  # CLIP returns its loss only when asked
    return {**{k: torch.stack([it[k] for it in items]) for k in items[0]}, "return_loss": True}


def test_clip_two_towers_under_the_trainer(tmp_path):
    """Both towers' maps equal the model's own (the text's causal, its padding unseen);
    norms by hand, `logit_scale` a layer of its own (the root's); no logits figures (its
    `logits_per_image` score images against captions, no vocabulary), and the probe event
    says so without the `probe_fn=... .logits` line it gave, which raised AttributeError
    at the next eval and failed the run; TFLOP/s count every weight for every caption
    token, and the run says once that this is an estimate."""
    torch.manual_seed(0)
    model = tf.CLIPModel(tf.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2,
                         max_position_embeddings=16, eos_token_id=2, pad_token_id=0),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=16, patch_size=8),
        projection_dim=8, attn_implementation="sdpa"))
    val = image_text(4, 1)
    run, df, _ = run_under_trainer(tmp_path, model, image_text(24, 0), val, with_loss)
    assert "grad_norm/(root)" in df  # logit_scale

    probe = probe_of(val)
    with torch.no_grad():
        out = eager_copy(model)(**probe, output_attentions=True)
    for sample, real in enumerate(probe["attention_mask"].sum(-1).tolist()):
        maps = run.attention(step=6, sample=sample)
        assert len(maps) == 4
        for i in (0, 1):
            text = maps[f"text_model.encoder.layers.{i}.self_attn"]
            np.testing.assert_allclose(text, out.text_model_output.attentions[i][sample],
                                       rtol=1e-3, atol=1e-4)
            assert np.abs(np.triu(text, 1)).max() == 0.0
            assert np.abs(text[:, :, real:]).max(initial=0.0) == 0.0
            vision = maps[f"vision_model.encoder.layers.{i}.self_attn"]
            assert vision.shape == (2, 5, 5)  # 4 patches and the class token
            np.testing.assert_allclose(vision, out.vision_model_output.attentions[i][sample],
                                       rtol=1e-3, atol=1e-4)

    assert not [c for c in df if c.startswith(("logits/", "train_logits/"))]
    said = run.events.query("kind == 'probe'")
    assert len(said) == 1 and said.severity.iloc[0] == "info"
    msg = said.message.iloc[0]
    assert "CLIPOutput" in msg and "logits_per_image" in msg and "probe_fn" not in msg
    with pytest.raises(AttributeError):
        model(**probe).logits  # noqa: B018  # the line the event used to give
    notes = run.events.query("kind == 'state'").message
    assert notes.str.contains("vision tower").sum() == 1
    # every parameter but the looked-up tables (tokens, both towers' positions), per
    # caption token, and 12·L·T·d over its 4 attention layers, T the padded caption
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    n = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    rates = df.dropna(subset=["throughput/tflops"])
    per_token = 6 * n + 12 * 4 * 10 * 16
    assert (rates["throughput/tflops"] * 1e12 / rates["throughput/tokens_per_s"]).tolist() \
        == pytest.approx([per_token] * len(rates), rel=1e-5)


# -- Whisper, Qwen2-MoE and ModernBERT under the Trainer: what users rely on, pinned -------


def speech(n: int, seed: int) -> list[dict]:
    """8 mel bins × 20 frames of noise, and 3 to 8 target tokens (-100 after them)."""
    g, items = torch.Generator().manual_seed(seed), []
    for _ in range(n):
        labels = torch.randint(3, VOCAB, (8,), generator=g)
        labels[int(torch.randint(3, 9, (1,), generator=g)):] = -100
        items.append({"input_features": torch.randn(8, 20, generator=g), "labels": labels})
    return items


def test_whisper_under_the_trainer(tmp_path):
    """Features in, no input_ids: norms, LR and loss as by hand and the Trainer's; log Z of
    the decoder's logits over the target's real tokens; samples/s from input_features;
    encoder self (frames after the stride-2 conv), causal decoder self
    and decoder × encoder cross maps, each the model's own."""
    torch.manual_seed(0)
    model = tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, d_model=16,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=10,
        max_target_positions=16, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2))
    val = speech(4, 1)
    run, df, forwards = run_under_trainer(tmp_path, model, speech(24, 0), val)
    assert_logits_by_hand(df, forwards, lambda inputs: inputs["labels"] != -100)
    assert df["throughput/samples_per_s"].tolist() == pytest.approx(
        (4 / df["time/step"]).tolist(), rel=1e-5)
    # no tokens/s, so no TFLOP/s or MFU: nothing said of them (the encoder-decoder's note)
    assert "throughput/tflops" not in df and "throughput/tokens_per_s" not in df
    assert not run.events.message.str.contains("estimates").any()

    with torch.no_grad():
        out = eager_copy(model)(**probe_of(val), output_attentions=True)
    for sample in (0, 1):
        maps = run.attention(step=6, sample=sample)
        for i in (0, 1):
            for name, theirs, shape in (
                    (f"model.encoder.layers.{i}.self_attn", out.encoder_attentions, (10, 10)),
                    (f"model.decoder.layers.{i}.self_attn", out.decoder_attentions, (8, 8)),
                    (f"model.decoder.layers.{i}.encoder_attn", out.cross_attentions, (8, 10))):
                assert maps[name].shape == (2, *shape)
                np.testing.assert_allclose(maps[name], theirs[i][sample], rtol=1e-3, atol=1e-4)
            assert np.abs(np.triu(maps[f"model.decoder.layers.{i}.self_attn"], 1)).max() == 0


def test_qwen2_moe_routed_and_shared_experts_under_the_trainer(tmp_path):
    """Transformers 5's fused experts are one layer a block (`mlp.experts`), beside the
    router (`mlp.gate`), the shared expert and its gate; the loss is the Trainer's (the
    router's aux loss in it); TFLOP/s count a routed expert's weights k/E = 2/4 times and
    the shared expert's whole; maps of the 2 query heads over 1 key/value head, the
    model's own."""
    torch.manual_seed(0)
    model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=32, output_router_logits=True, router_aux_loss_coef=0.01,
        attn_implementation="sdpa"))
    val = Padded(4, 1, vocab=VOCAB, T=16, shortest=6)
    run, df, forwards = run_under_trainer(
        tmp_path, model, Padded(24, 0, vocab=VOCAB, T=16, shortest=6), val)
    assert {f"grad_norm/model.layers.{i}.mlp.{m}" for i in (0, 1) for m in (
        "experts", "gate", "shared_expert.up_proj", "shared_expert_gate")} <= set(df)
    assert_logits_by_hand(df, forwards, lambda inputs: inputs["attention_mask"])
    active = sum(p.numel() * (2 / 4 if ".mlp.experts." in n else 1)
                 for n, p in model.named_parameters() if "embed_tokens" not in n)
    per_token = 6 * active + 12 * 2 * 16 * 16  # 2 layers, every row padded to T = 16, d 16
    assert (df["throughput/tflops"] * 1e12 / df["throughput/tokens_per_s"]).tolist() \
        == pytest.approx([per_token] * 6, rel=1e-5)

    with torch.no_grad():
        out = eager_copy(model)(**probe_of(val), output_attentions=True)
    for sample in (0, 1):
        maps = run.attention(step=6, sample=sample)
        for i in (0, 1):
            np.testing.assert_allclose(maps[f"model.layers.{i}.self_attn"],
                                       out.attentions[i][sample], rtol=1e-3, atol=1e-4)


def masked(n: int, seed: int) -> list[dict]:
    """`Padded`'s sequences with ~30% of their real tokens (the first always) masked to 1,
    labels there only."""
    g, items = torch.Generator().manual_seed(seed + 7), []
    for it in Padded(n, seed, vocab=VOCAB, T=16, shortest=6).items:
        ids, mask = it["input_ids"], it["attention_mask"]
        pick = (torch.rand(16, generator=g) < 0.3) & (mask == 1)
        pick[0] = True
        items.append({"input_ids": ids.masked_fill(pick, 1), "attention_mask": mask,
                      "labels": ids.masked_fill(~pick, -100)})
    return items


def test_modernbert_local_and_global_layers_under_the_trainer(tmp_path):
    """Layer 0 global, 1 and 2 a sliding window of 4 (2 tokens each way): the maps equal
    the model's own on every real query, and give no weight beyond the window or to
    padding; its sparse prediction runs the head on the masked tokens alone ([N, V]
    logits), whose log Z is the step's."""
    torch.manual_seed(0)
    model = tf.ModernBertForMaskedLM(tf.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, max_position_embeddings=32, global_attn_every_n_layers=3,
        local_attention=4, pad_token_id=0, sparse_prediction=True, attn_implementation="sdpa"))
    val = masked(4, 1)
    run, df, forwards = run_under_trainer(tmp_path, model, masked(24, 0), val)
    assert all(logits.dim() == 2 for logits, _ in forwards)
    assert_logits_by_hand(df, forwards, lambda inputs: None)

    probe = probe_of(val)
    with torch.no_grad():
        out = eager_copy(model)(**probe, output_attentions=True)
    q, k = np.indices((16, 16))
    for sample, real in enumerate(probe["attention_mask"].sum(-1).tolist()):
        maps = run.attention(step=6, sample=sample)
        for i in (0, 1, 2):
            w = maps[f"model.layers.{i}.attn"][:, :real]  # a padded query's row is no map
            np.testing.assert_allclose(w, out.attentions[i][sample][:, :real],
                                       rtol=1e-3, atol=1e-4)
            assert np.abs(w[:, :, real:]).max(initial=0.0) == 0.0
            outside = (np.abs(q - k) > 2)[:real]
            assert (np.abs(w[:, outside]).max() == 0.0) == (i > 0)
