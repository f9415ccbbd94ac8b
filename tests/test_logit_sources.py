"""The per-step logits figures (`train_logits/log_z`, `train_logits/max_abs`) from each
source: `start()`'s step_fn returning `logits`, an own loop's `log(logits=...)`, and the
output layer's forward hook under the Hugging Face Trainer and Lightning. Each recorded
figure equals `logit_parts` of the logits that step trained on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.probes.logits import LOG_Z, MAX_ABS, logit_parts

from .conftest import make_batches


def expected(kept: list[tuple[torch.Tensor, torch.Tensor | None]]) -> np.ndarray:
    return np.array([[p.item() for p in logit_parts(x, m)] for x, m in kept])


def test_start_records_the_step_fns_logits_every_step(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept = []

    def step_fn(model, batch):
        logits = model(batch["input_ids"])
        if model.training:
            kept.append((logits.detach().clone(), batch["mask"]))
        return {"logits": logits, "labels": batch["labels"], "mask": batch["mask"]}

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(step_fn, make_batches(8), max_steps=8, accumulate=2, display=False).wait()
    df = nbwatch.open_run(tmp_path / "run").df
    got = df[[LOG_Z, MAX_ABS]].to_numpy()
    # the first micro-batch of each step: a cost that does not grow with accumulation
    assert got == pytest.approx(expected(kept[::2]), rel=1e-6)
    assert df[LOG_Z].gt(0).all()  # log Z ≥ log V − max|logit| > 0 for logits this small


def test_an_own_loop_passes_its_logits_to_log(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    kept = []
    with mon:
        for b in make_batches(5):
            logits = model(b["input_ids"])
            nbwatch.masked_cross_entropy(logits, b["labels"], b["mask"]).backward()
            opt.step()
            opt.zero_grad()
            kept.append((logits.detach().clone(), b["mask"]))
            mon.log(logits=logits, mask=b["mask"])
    got = mon.df[[LOG_Z, MAX_ABS]].to_numpy()
    assert got == pytest.approx(expected(kept), rel=1e-6)
    assert "loss/train" not in mon.df  # no loss given: logits alone are no loss


def test_log_refuses_what_cannot_be_logits(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=1, heads=2, ctx=32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    b = make_batches(1)[0]
    with mon:
        loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
        loss.backward()
        opt.step()
        with pytest.raises(TypeError, match=r"logits is a tensor of shape \(\).*logits=out"):
            mon.log(loss=loss, logits=loss)


def test_the_hf_trainer_records_its_lm_heads_logits_and_the_hook_goes(tmp_path):
    pytest.importorskip("transformers")
    import nbwatch.hf
    from tests.test_hf import make_trainer

    trainer = make_trainer(tmp_path / "out", max_steps=6, eval_steps=3)
    head = trainer.model.get_output_embeddings()
    kept = []

    def keep(mod, args, out):  # what the Trainer's training forwards computed
        if mod.training and torch.is_grad_enabled():
            kept.append((out.detach().clone(), None))

    mine = head.register_forward_hook(keep)
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    run.wait()
    mine.remove()
    assert run.state == "finished" and len(kept) == 6  # the evals' forwards did not count
    got = run.df[[LOG_Z, MAX_ABS]].to_numpy()
    assert got == pytest.approx(expected(kept), rel=1e-6)
    assert not head._forward_hooks  # nbwatch's hook removed at the fit's end


def test_lightning_records_the_output_layers_logits_and_the_hook_goes(tmp_path):
    pytest.importorskip("lightning.pytorch")
    import nbwatch.lightning
    from tests.test_lightning import TinyModule, loader, make_trainer

    torch.manual_seed(0)
    module = TinyModule()
    trainer = make_trainer(tmp_path / "pl", max_steps=6, val_check_interval=3)
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=loader(8),
                                  val_dataloaders=loader(2, seed=1), run_dir=tmp_path / "run",
                                  display=False)
    run.wait()
    assert run.state == "finished"
    df = run.df.dropna(subset=["loss/train"])
    assert df[LOG_Z].notna().all() and df[MAX_ABS].gt(0).all() and len(df) == 6
    assert not module.net.head._forward_hooks
