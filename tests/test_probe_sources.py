"""Where the probe pass gets its figures on real setups: the output logits of a Hugging Face
causal LM whose `step_fn` returns only its loss, the inner model of a LightningModule that
has no `forward`, and, where nbwatch cannot get a figure, the probe event and the Health
panel saying why, with the line to add."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.panels import Feed
from nbwatch.store import RunReader

from .conftest import make_batches

tf = pytest.importorskip("transformers")


def tiny_gpt2(**kw) -> nn.Module:
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64,
                                            n_positions=32, bos_token_id=0, eos_token_id=0,
                                            pad_token_id=0, **kw))


def hf_batches(n: int = 12, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Padded batches as a tokenizer gives them; labels are the inputs (the model shifts
    them inside), -100 on padding."""
    out = []
    for b in make_batches(n, seed=seed):
        ids, mask = b["input_ids"], (b["input_ids"] != 0).long()
        out.append({"input_ids": ids, "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)})
    return out


def probe_events(events, missing: str | None = None):
    probes = events[events.kind == "probe"]
    if missing is None:
        return probes
    return probes[[(d or {}).get("missing") == missing for d in probes.data]]


def health_panel(run_dir) -> dict:
    feed = Feed(RunReader(run_dir))
    while feed.update() is not None and feed.more:
        pass
    return feed.full()["health"]


def test_hf_causal_lm_returning_only_its_loss_records_the_output_logits(tmp_path):
    """The README's Hugging Face form, `return {"loss": out.loss}`: the probe pass reads
    the logits from the model's own output, so the log-partition series exist, equal the
    model's logits, and the output_logit_drift rule watches them."""
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    data = hf_batches()
    probe = data[-1]

    def step_fn(model, batch):
        out = model(**batch)
        return {"loss": out.loss, "mask": batch["attention_mask"]}

    # a drift of 1e-6 nats: the rule fires as soon as it has two probes to compare
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run",
                          alerts={"output_logit_drift": {"nats": 1e-6}})
    mon.start(step_fn, data, max_steps=9, eval_every=3, probe_batch=probe, display=False)
    mon.wait()
    assert mon.state == "finished"
    df = mon.df
    z, top = df["logits/z_mean"].dropna(), df["logits/max_abs"].dropna()
    assert list(z.index) == list(top.index) == [3, 6, 9]
    model.eval()
    with torch.no_grad():  # the weights of the last eval: training ended at that step
        logits = model(**{k: v[:2] for k, v in probe.items()}).logits.float()
    assert z[9] == pytest.approx(float(torch.logsumexp(logits, -1).mean()), rel=1e-4)
    assert top[9] == pytest.approx(float(logits.abs().max()), rel=1e-4)
    assert math.log(64) <= z[9]  # log Σ exp over 64 logits is at least log 64 + their mean
    alerts = mon.events[mon.events.kind == "alert"].message.tolist()
    assert any(m.startswith("output_logit_drift") for m in alerts), alerts
    assert probe_events(mon.events).empty  # nothing to say: every figure was taken
    assert sorted(nbwatch.open_run(tmp_path / "run").attention()) == [
        "transformer.h.0.attn", "transformer.h.1.attn"]


class LossOnly(nn.Module):
    """A causal LM that computes its loss inside and returns only that, its output
    projection the token embedding itself (`x @ wte.weight.T`): no layer gives logits."""

    def __init__(self, vocab: int = 64, d: int = 32):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.norm = nn.LayerNorm(d)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids)
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = self.norm(x + a.transpose(1, 2).reshape(x.shape))
        return x @ self.wte.weight.T

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.logits(input_ids)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=0)


def test_no_logits_anywhere_is_said_once_with_the_line_and_the_panel_shows_it(tmp_path):
    torch.manual_seed(0)
    model = LossOnly()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_batches(12)

    def step_fn(model, batch):
        return model(batch["input_ids"], batch["labels"])

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(step_fn, data, max_steps=6, eval_every=2, probe_batch=data[0], display=False)
    mon.wait()
    said = probe_events(mon.events, "logits")
    assert len(said) == 1  # three probes, one event
    msg = said.message.iloc[0]
    assert "output_logit_drift" in msg and "logits/z_mean" in msg
    assert 'return them from step_fn (return {"loss": out.loss, "logits": out.logits})' in msg
    assert "start(..., probe_fn=lambda model, batch:" in msg
    assert not any(c.startswith("logits/") for c in mon.df.columns)
    # the probe stays on: attention and the residual stream are still measured
    attn = [c for c in mon.df.columns if c.startswith("attn/max_logit/")]
    assert attn and all(mon.df[c].notna().sum() == 3 for c in attn)
    panel = health_panel(tmp_path / "run")
    assert panel["notes"] == {"logits": msg} and "z" not in panel and "max_logit" in panel

    # what the message says to do: a probe_fn that returns the logits
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "fixed")
    mon.start(step_fn, data, max_steps=2, eval_every=2, probe_batch=data[0], display=False,
              probe_fn=lambda model, batch: model.logits(batch["input_ids"]))
    mon.wait()
    assert mon.df["logits/z_mean"].notna().sum() == 1
    assert probe_events(mon.events).empty


def test_own_loop_default_probe_passes_the_entries_the_forward_names(tmp_path):
    """A loop of the user's own, no probe_fn: `model(**batch)` would fail on a batch that
    carries more than the forward takes (labels, a mask); the probe passes what it names
    (here `input_ids`, positionally, the forward naming none of the keys)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_batches(4)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", probe_batch=data[0])

    def train():
        for i, b in enumerate(data, 1):
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss, mask=b["mask"], val=loss.item() if i % 2 == 0 else None)

    mon.run(train).wait()
    assert mon.df["logits/z_mean"].notna().sum() == 2
    assert probe_events(mon.events).empty
    assert sorted(nbwatch.open_run(tmp_path / "run").attention()) == [
        "blocks.0.attn", "blocks.1.attn"]


# -- Lightning --------------------------------------------------------------------------
L = pytest.importorskip("lightning.pytorch")
import nbwatch.lightning  # noqa: E402


class Wraps(L.LightningModule):
    """As many modules are written: no forward; training_step calls the inner model."""

    def __init__(self, inner: nn.Module, name: str = "model"):
        super().__init__()
        self.name = name
        setattr(self, name, inner)

    def inner(self) -> nn.Module:
        return getattr(self, self.name)

    def training_step(self, batch, batch_idx):
        return self.inner()(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.inner()(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TwoNets(L.LightningModule):
    """No forward, and two inner models of no telling name: nbwatch cannot choose."""

    def __init__(self):
        super().__init__()
        self.student = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
        self.teacher = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32).requires_grad_(False)

    def _loss(self, batch):
        return nbwatch.masked_cross_entropy(self.student(batch["input_ids"]), batch["labels"],
                                            batch["mask"])

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.student.parameters(), lr=1e-3)


def fit(tmp_path, module, train, val, **monitor):
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path / "pl"),
                        val_check_interval=2, num_sanity_val_steps=0,
                        check_val_every_n_epoch=None, enable_checkpointing=False)
    loader = lambda d: torch.utils.data.DataLoader(d, batch_size=None)  # noqa: E731
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=loader(train),
                                  val_dataloaders=loader(val), run_dir=tmp_path / "run",
                                  display=False, monitor=monitor or None)
    run.wait()
    assert run.state == "finished"
    return run


def test_lightning_module_without_forward_probes_its_inner_hf_model(tmp_path):
    run = fit(tmp_path, Wraps(tiny_gpt2(attn_implementation="eager"), "backbone"),
              hf_batches(8), hf_batches(2, seed=1))
    maps = nbwatch.open_run(tmp_path / "run").attention()
    assert sorted(maps) == ["backbone.transformer.h.0.attn", "backbone.transformer.h.1.attn"]
    df = run.df
    assert df["logits/z_mean"].notna().sum() == 2  # the evals at steps 2 and 4
    assert df["attn/max_logit/backbone.transformer.h.0.attn"].notna().sum() == 2
    assert df["act/rms/backbone.transformer.h.1"].notna().sum() == 2
    assert probe_events(run.events).empty


def test_lightning_module_without_a_choice_says_the_lightning_line(tmp_path):
    run = fit(tmp_path, TwoNets(), make_batches(8), make_batches(2, seed=1))
    said = probe_events(run.events)
    assert len(said) == 1
    msg = said.message.iloc[0]
    line = 'lambda module, batch: module.student(batch["input_ids"])'
    assert f"NbwatchCallback(probe_fn={line})" in msg
    assert f'nbwatch.lightning.start(..., monitor={{"probe_fn": {line}}})' in msg
    assert "student, teacher" in msg and "nbwatch.Monitor" not in msg
    assert nbwatch.open_run(tmp_path / "run").attention() == {}
    assert health_panel(tmp_path / "run")["notes"] == {"probe": msg}

    # the line it gives, as given
    run = fit(tmp_path / "again", TwoNets(), make_batches(8), make_batches(2, seed=1),
              probe_fn=lambda module, batch: module.student(batch["input_ids"]))
    assert sorted(nbwatch.open_run(tmp_path / "again" / "run").attention()) == [
        "student.blocks.0.attn", "student.blocks.1.attn"]
    assert run.df["logits/z_mean"].notna().sum() == 2
