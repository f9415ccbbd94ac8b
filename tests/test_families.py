"""Model families and setups beyond GPT-2/BERT/T5, each a tiny real model built from its
config (no download): Llama with grouped-query attention and Mistral with a sliding
window under the Trainer, a PEFT LoRA model in a loop of its own, and gradient
checkpointing under bf16 autocast. Every figure is checked against the model's own:
the loss it returns (the Trainer's logged one), torch's norm of the gradients before
the clip, and the attention weights the model itself gives with `output_attentions`."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch

tf = pytest.importorskip("transformers")

import nbwatch  # noqa: E402
import nbwatch.hf  # noqa: E402
from tests.scripts.data_ranks import opaque  # noqa: E402
from tests.scripts.wide_run import Padded  # noqa: E402

VOCAB, MAX_NORM = 64, 0.5


def tiny_llama(attn: str = "eager") -> torch.nn.Module:
    """2 layers, 4 query heads sharing 2 key/value heads (grouped-query attention)."""
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
        attn_implementation=attn))


def make_trainer(out, model, train, val, max_steps: int = 6, **args):
    kw = dict(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
              per_device_eval_batch_size=4, logging_steps=1, report_to=[], save_strategy="no",
              eval_strategy="steps", eval_steps=max_steps, learning_rate=3e-3,
              max_grad_norm=MAX_NORM, use_cpu=True, disable_tqdm=True, seed=0,
              log_level="error")
    kw.update(args)
    return tf.Trainer(model=model, args=tf.TrainingArguments(**kw), train_dataset=train,
                      eval_dataset=val)


def trainer_log(trainer, key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


def probe_of(dataset, n: int = 2) -> dict[str, torch.Tensor]:
    """The probe's samples under the Trainer: the first `n` of the first eval batch."""
    items = [dataset[i] for i in range(n)]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def own_attentions(model, batch, bf16: bool = False) -> list[np.ndarray]:
    """The model's own attention weights [samples, heads, T, S] per layer, from its eager
    attention (`output_attentions=True`) on the weights it has now; `bf16`: under the
    autocast its forward ran in (the Trainer's bf16 wraps the model's forward in it)."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    ref.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = ref(**batch, output_attentions=True)
    return [a.float().numpy() for a in out.attentions]


def assert_maps_are_the_models(run_dir, step, names, own, heads=4, atol=1e-4):
    """Recorded maps [heads, T, T] of each probe sample: rows sum to 1 and equal the
    model's own weights (stored as float16: 2⁻¹¹ relative, plus `atol`)."""
    run = nbwatch.open_run(run_dir)
    for sample in range(own[0].shape[0]):
        maps = run.attention(step=step, sample=sample)
        assert sorted(maps) == names
        for name, theirs in zip(names, own):
            w = maps[name]
            assert w.shape == (heads, *theirs.shape[-2:]), (name, w.shape)
            np.testing.assert_allclose(w.sum(-1), 1.0, atol=3e-3)
            np.testing.assert_allclose(w, theirs[sample], rtol=1e-3, atol=atol,
                                       err_msg=f"{name} sample {sample}")
    return run


def assert_step_figures_are_the_trainers(df, trainer, steps):
    assert list(df.dropna(subset=["loss/train"]).index) == list(range(1, steps + 1))
    for key, ours in (("loss", "loss/train"), ("grad_norm", "grad_norm/global")):
        theirs = trainer_log(trainer, key)
        assert sorted(theirs) == list(range(1, steps + 1)), key
        for step, v in theirs.items():
            assert df.loc[step, ours] == pytest.approx(v, rel=1e-5), (key, step)
    # the Trainer clipped at MAX_NORM: after its clip, the norm torch's rule leaves
    pre = df["grad_norm/global"]
    after = pre * np.minimum(1.0, MAX_NORM / (pre + 1e-6))
    assert df["grad_norm/clipped"].tolist() == pytest.approx(after.tolist(), rel=1e-4)
    assert (pre > MAX_NORM).any()  # some step was really clipped


@pytest.mark.parametrize("attn", ["eager", "sdpa", "opaque"])
def test_llama_grouped_query_attention_under_the_trainer(tmp_path, attn):
    """Eager: padded probe samples, the weights the layers return. SDPA: unpadded probe
    samples, so transformers passes the 2 key/value heads to SDPA unrepeated
    (`enable_gqa=True`) and the probe recomputes the 4 query heads' weights from them.
    Opaque: a kernel that gives no weights (flash_attention_2's kind) runs as SDPA for
    the probe pass, and as itself again for training."""
    if attn == "opaque":
        tf.AttentionInterface.register("opaque", opaque)  # gives no weights
    model = tiny_llama(attn)
    assert model.model.layers[0].self_attn.k_proj.out_features == 16  # 2 kv heads × 8
    T = 16
    val = Padded(4, 1, vocab=VOCAB, T=T, shortest=6 if attn == "eager" else T)
    trainer = make_trainer(tmp_path / "out", model, Padded(24, 0, vocab=VOCAB, T=T, shortest=6),
                           val)
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished" and run.step == 6
    assert model.config._attn_implementation == attn  # as it was, after every probe pass
    assert model.model.layers[1].self_attn.config._attn_implementation == attn
    assert not run.events.query("kind == 'probe'").message.tolist()
    df = run.df
    assert_step_figures_are_the_trainers(df, trainer, 6)
    assert {"grad_norm/model.layers.0.self_attn.k_proj",
            "grad_norm/model.layers.1.self_attn.v_proj"} <= set(df.columns)

    probe = probe_of(val)
    own = own_attentions(model, probe)
    names = [f"model.layers.{i}.self_attn" for i in (0, 1)]
    run = assert_maps_are_the_models(tmp_path / "run", 6, names, own)
    lengths = probe["attention_mask"].sum(-1).tolist()
    assert (min(lengths) < T) == (attn == "eager")  # the eager probe has a padded sample
    for sample, real in enumerate(lengths):
        maps = run.attention(step=6, sample=sample)
        for name in names:
            w = maps[name]
            assert np.abs(np.triu(w, 1)).max() == 0.0  # causal: no query looks ahead
            assert np.abs(w[:, :, real:]).max(initial=0.0) == 0.0  # padded keys: no weight
            # each query head has its own map (heads sharing a kv head differ)
            assert not np.allclose(w[0], w[1], atol=1e-3)


def test_a_flash_attention_class_chosen_at_init_keeps_its_kernel_for_the_probe(tmp_path,
                                                                               monkeypatch):
    """GPT-Neo on flash_attention_2 picks its attention class at init (as every model of
    transformers before 4.48 did): switching its config to eager for the probe pass made
    the model build a 4-D mask for a kernel that reads [batch, T] (transformers' own
    unpadding, here before the kernel: indices past the keys, on a GPU a device-side
    assert), and the run failed at its first eval. Its pass runs on its own kernel now:
    no maps, said once as a warning, act/rms and logits at every eval."""
    from transformers import modeling_flash_attention_utils as fa
    from transformers.models.gpt_neo import modeling_gpt_neo as neo

    def kernel(q, k, v, attention_mask, query_length, is_causal=True, dropout=0.0,
               softmax_scale=None, **kw):  # flash-attn's, on the CPU: [batch, T, heads, d]
        if attention_mask is not None:  # transformers' unpadding of the keys, as on a GPU
            fa._index_first_axis(k, fa._get_unpad_data(attention_mask)[0])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        s = q @ k.transpose(-1, -2) * (softmax_scale or q.shape[-1] ** -0.5)
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        if attention_mask is not None:
            keep = keep & attention_mask[:, None, None, :].bool()
        return (s.masked_fill(~keep, float("-inf")).softmax(-1) @ v).transpose(1, 2)

    # (imported there only where flash-attn is installed)
    monkeypatch.setattr(neo, "_flash_attention_forward", kernel, raising=False)
    torch.manual_seed(0)
    config = tf.GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                             attention_types=[[["global", "global"], 1]],
                             max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    model = tf.GPTNeoForCausalLM(config)
    for i, block in enumerate(model.transformer.h):  # what attn_implementation= builds on
        flash = neo.GPTNeoFlashAttention2(config, block.attn.attention.attention_type, i)
        flash.load_state_dict(block.attn.attention.state_dict())  # a GPU with flash-attn
        block.attn.attention = flash
    model.config._attn_implementation_internal = "flash_attention_2"
    ids = torch.randint(1, VOCAB, (4, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    mon = nbwatch.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          run_dir=tmp_path / "r")
    mon.start(lambda m, b: m(**b).loss, [batch] * 4, max_steps=4, eval_every=2,
              probe_batch=batch, display=False).wait()
    assert mon.state == "finished" and mon.step == 4
    assert model.config._attn_implementation == "flash_attention_2"
    probes = mon.events.query("kind == 'probe'")
    assert len(probes) == 1 and probes.severity.iloc[0] == "warning", probes.message.tolist()
    assert "saw no attention weights" in probes.message.iloc[0]
    for key in ("act/rms/transformer.h.1", "logits/z_mean"):
        assert mon.df[key].dropna().index.tolist() == [2, 4], key


def test_mistral_sliding_window_maps_give_no_weight_beyond_the_window(tmp_path):
    T, WINDOW = 16, 8
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(
        num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
        sliding_window=WINDOW, attn_implementation="eager"))
    val = Padded(4, 1, vocab=VOCAB, T=T, shortest=T)  # every sequence the full 16 tokens
    trainer = make_trainer(tmp_path / "out", model, Padded(24, 0, vocab=VOCAB, T=T, shortest=T),
                           val)
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished"
    assert_step_figures_are_the_trainers(run.df, trainer, 6)

    own = own_attentions(model, probe_of(val))
    names = [f"model.layers.{i}.self_attn" for i in (0, 1)]
    run = assert_maps_are_the_models(tmp_path / "run", 6, names, own)
    q, k = np.indices((T, T))
    outside = (q - k >= WINDOW) | (k > q)  # further back than the window, or ahead
    inside = ~outside
    for sample in (0, 1):
        for name, theirs in zip(names, own):
            w = run.attention(step=6, sample=sample)[name]
            assert np.abs(w[:, outside]).max() <= 1e-6  # as the model's own:
            assert np.abs(theirs[sample][:, outside]).max() <= 1e-6
            assert (w[:, inside] > 0).all()  # the whole window is attended
            assert (w[:, T - 1, T - WINDOW] > 0).all()  # the oldest key still in it


def test_peft_lora_in_a_loop_of_its_own(tmp_path):
    """Only the LoRA matrices train: they alone have gradients, they alone have per-layer
    norms, and the global norm is torch's over them; the probe goes through the PEFT
    wrapper to the base model's attention."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama("eager"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    opt = torch.optim.AdamW(lora.values(), lr=1e-2)
    data = Padded(40, 0, vocab=VOCAB, T=16, shortest=6)
    batches = [probe_of(torch.utils.data.Subset(data, range(i, i + 4)), 4)
               for i in range(0, 40, 4)]
    probe = probe_of(Padded(2, 1, vocab=VOCAB, T=16, shortest=6))

    losses, norms, layer_norms = [], [], []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", probe_batch=probe,
                         display=False) as mon:
        for i, batch in enumerate(batches, 1):
            loss = model(**batch).loss
            loss.backward()
            with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
            assert with_grad == set(lora), with_grad ^ set(lora)
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in lora.values()])))
            layer_norms.append({n.rpartition(".")[0]: float(p.grad.norm())
                                for n, p in lora.items()})
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss, mask=batch["attention_mask"],
                    val=loss.item() if i % 5 == 0 else None)
    assert mon.state == "finished" and mon.step == len(batches)
    df = mon.df
    assert df["loss/train"].tolist() == pytest.approx(losses, rel=1e-5)
    assert df["grad_norm/global"].tolist() == pytest.approx(norms, rel=1e-5)
    per_layer = sorted(c for c in df if c.startswith("grad_norm/")
                       and c not in ("grad_norm/global", "grad_norm/clipped"))
    # q_proj and v_proj of both layers, lora_A and lora_B each: nothing of the frozen base
    assert len(per_layer) == 8 and all("lora_" in c for c in per_layer), per_layer
    assert per_layer == sorted(f"grad_norm/{m}" for m in layer_norms[0])
    for step, figures in enumerate(layer_norms, 1):
        for m, v in figures.items():
            assert df.loc[step, f"grad_norm/{m}"] == pytest.approx(v, rel=1e-5, abs=1e-12)
    assert df["grad_norm/base_model.model.model.layers.0.self_attn.q_proj.lora_A.default"
              ].iloc[-1] > 0  # lora_B left zero: A's gradient is 0 at step 1 only

    names = [f"base_model.model.model.layers.{i}.self_attn" for i in (0, 1)]
    assert_maps_are_the_models(tmp_path / "run", len(batches), names,
                               own_attentions(model, probe))
    assert sorted(nbwatch.open_run(tmp_path / "run").reader.attention_steps()) == [5, 10]


def test_a_lora_checkpoint_holds_the_adapters_not_the_frozen_base(tmp_path):
    """A PEFT model's checkpoint leaves its frozen base out (a 7B bf16 base would be 13 GB
    a checkpoint, the script loads it anyway) and keeps what trains and the buffers; a
    resume into the same base built again goes on with the trained adapters."""
    peft = pytest.importorskip("peft")

    def lora_model():
        return peft.get_peft_model(tiny_llama("eager"), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))

    model = lora_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data = Padded(16, 0, vocab=VOCAB, T=16, shortest=6)
    batches = [probe_of(torch.utils.data.Subset(data, range(i, i + 4)), 4)
               for i in range(0, 16, 4)]
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", display=False) as mon:
        for batch in batches:
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
    (path,) = (tmp_path / "run" / "checkpoints").glob("step_*.pt")
    saved = nbwatch.checkpoint.load(path)["model"]
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert set(trained) <= set(saved) and not set(saved) & frozen, sorted(saved)[:8]
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert set(model.state_dict()) - params <= set(saved)  # the buffers it saves

    again = lora_model()  # the same pretrained base, the adapters new
    assert any(not torch.equal(p, trained[n]) for n, p in again.named_parameters()
               if n in trained)
    opt2 = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad], lr=1e-2)
    with nbwatch.Monitor(again, opt2, run_dir=tmp_path / "run", display=False,
                         resume=True) as mon2:
        assert mon2.step == len(batches)
        for n, p in again.named_parameters():
            if n in trained:
                assert torch.equal(p, trained[n]), n
        assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_preflight_of_a_lora_model_keeps_a_copy_of_the_adapters_alone(tmp_path, monkeypatch):
    """`preflight()` copies what it restores after its trial: a PEFT model's adapters, not
    its frozen base (as its checkpoints), and puts them back as they were."""
    peft = pytest.importorskip("peft")
    from nbwatch.monitor import preflight

    model = peft.get_peft_model(tiny_llama("eager"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    for n, p in model.named_parameters():  # lora_B is zero as made: give it weights
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    copied: list[set] = []
    of_model = preflight.model_state
    monkeypatch.setattr(preflight, "model_state",
                        lambda m: copied.append(set(state := of_model(m))) or state)
    data = Padded(16, 0, vocab=VOCAB, T=16, shortest=6)
    batches = [probe_of(torch.utils.data.Subset(data, range(i, i + 4)), 4)
               for i in range(0, 16, 4)]
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", display=False)
    result = mon.preflight(lambda m, b: m(**b).loss, itertools.cycle(batches), steps=4)
    assert len(result.df) == 4, result  # the trial's steps, recorded apart
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert copied[0] and not copied[0] & frozen  # the adapters, not the base
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not opt.state


def test_gradient_checkpointing_under_bf16_autocast(tmp_path):
    """`gradient_checkpointing_enable()` and the Trainer's bf16 on the CPU (autocast): each
    layer's forward runs again in the backward, in bf16, and the steps, norms and the
    probe's attention maps are recorded as without either."""
    model = tiny_llama("sdpa")
    # transformers 5.x names it activation_checkpointing_enable (the old name warns)
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    assert model.model.layers[0].gradient_checkpointing
    calls, dtypes = [], set()

    def seen(mod, args, out):  # in training steps only (not the eval and probe passes)
        if mod.training:
            calls.append(1)
            dtypes.add(out.dtype)

    # the layer's forward is checkpointed (its own hooks stay outside): its q_proj runs
    # twice a step, in the forward and again in the backward's recompute
    hooks = [model.model.layers[0].self_attn.q_proj.register_forward_hook(seen)]
    T = 16
    val = Padded(4, 1, vocab=VOCAB, T=T, shortest=6)
    trainer = make_trainer(tmp_path / "out", model, Padded(24, 0, vocab=VOCAB, T=T, shortest=6),
                           val, bf16=True)
    try:
        run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
        run.wait()
    finally:
        for h in hooks:
            h.remove()
    assert run.state == "finished"
    assert len(calls) == 2 * 6  # forward, and again in the backward (recomputed)
    assert dtypes == {torch.bfloat16}  # under autocast
    df = run.df
    assert np.isfinite(df["loss/train"]).all() and np.isfinite(df["grad_norm/global"]).all()
    assert_step_figures_are_the_trainers(df, trainer, 6)
    names = [f"model.layers.{i}.self_attn" for i in (0, 1)]
    # the probe runs in the forward's bf16 autocast too, as the model's eval does: SDPA's
    # weights from its bf16 q and k, against eager's, whose QKᵀ is itself rounded to bf16
    # (8 significant bits): equal to bf16's precision
    own = own_attentions(model, probe_of(val), bf16=True)
    assert_maps_are_the_models(tmp_path / "run", 6, names, own, atol=4e-3)
    assert df["attn/max_logit/model.layers.0.self_attn"].notna().sum() == 1
