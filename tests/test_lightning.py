"""`nbwatch.lightning`: a real Lightning fit of a tiny GPT, watched and steered by nbwatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

import nbwatch  # noqa: E402
import nbwatch.lightning  # noqa: E402
from nbwatch.demo import TinyGPT  # noqa: E402

from .conftest import make_batches, until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class TinyModule(L.LightningModule):
    """A tiny GPT whose hooks write down what the fit computed, for comparison."""

    def __init__(self, delay: float = 0.0, warmup: int = 5):
        super().__init__()
        self.net = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
        self.delay, self.warmup = delay, warmup
        self.norms: list[float] = []
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def forward(self, input_ids):
        return self.net(input_ids)

    def training_step(self, batch, batch_idx):
        if self.delay:
            time.sleep(self.delay)
        loss = nbwatch.masked_cross_entropy(self.net(batch["input_ids"]), batch["labels"],
                                            batch["mask"])
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nbwatch.masked_cross_entropy(
            self.net(batch["input_ids"]), batch["labels"], batch["mask"]))

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack(grads)).item())
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        warm = self.warmup
        sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}


def loader(n: int, seed: int = 0):
    return torch.utils.data.DataLoader(make_batches(n, seed=seed), batch_size=None)


def make_trainer(root: Path, **kw):
    args = dict(max_steps=20, accelerator="cpu", logger=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=str(root), val_check_interval=10,
                num_sanity_val_steps=0, check_val_every_n_epoch=None)
    args.update(kw)
    return L.Trainer(**args)


def test_recorded_figures_equal_what_the_fit_computed(tmp_path):
    torch.manual_seed(0)
    module = TinyModule()
    trainer = make_trainer(tmp_path / "pl", gradient_clip_val=0.5)
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=loader(16),
                                  val_dataloaders=loader(2, seed=1), run_dir=tmp_path / "run",
                                  display=False,
                                  monitor={"probe_fn": lambda m, b: m(b["input_ids"])})
    run.wait()
    assert run.state == "finished" and run.step == 20 == trainer.global_step
    df = run.df.dropna(subset=["loss/train"])
    assert list(df.index) == list(range(1, 21))
    assert df["loss/train"].tolist() == pytest.approx(module.losses, rel=1e-6)
    assert df["grad_norm/global"].tolist() == pytest.approx(module.norms, rel=1e-5)  # pre-clip
    assert (df["grad_norm/clipped"] <= 0.5 + 1e-6).all()  # Lightning's clip, shown
    assert df["lr"].tolist() == pytest.approx(module.lrs)
    val = run.df["loss/val"].dropna()
    assert list(val.index) == [10, 20]
    assert run.df["data/padding_ratio"].dropna().between(0, 1).all()
    maps = nbwatch.open_run(tmp_path / "run").attention()
    assert sorted(maps) == ["net.blocks.0.attn", "net.blocks.1.attn"]


class ManualClip(TinyModule):
    """Manual optimization that clips its gradients itself before its step."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.before_clip: list[float] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        grads = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.before_clip.append(torch.linalg.vector_norm(torch.stack(grads)).item())
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()
        self.lr_schedulers().step()
        return loss


def test_manual_optimizations_own_clip_is_divided_out_of_the_norms(tmp_path):
    """`self.clip_gradients(...)` before `opt.step()` in a manual optimization: the norms
    recorded are those before it, as in a loop of one's own (they were the clipped ones:
    `grad_norm/global` read the clip's limit at every step)."""
    torch.manual_seed(0)
    module = ManualClip()
    trainer = make_trainer(tmp_path / "pl", max_steps=6, val_check_interval=None,
                           check_val_every_n_epoch=None, limit_val_batches=0)
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=loader(16),
                                  run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished" and run.step == 6, run.error
    df = run.df
    assert min(module.before_clip) > 0.1  # the clip cut every step
    assert df["grad_norm/global"].tolist() == pytest.approx(module.before_clip, rel=1e-5)
    assert df["grad_norm/clipped"].tolist() == pytest.approx([0.05] * 6, rel=1e-4)
    assert module.norms == pytest.approx([0.05] * 6, rel=1e-4)  # what the step used


def test_pause_cut_lr_checkpoint_stop_through_lightning(tmp_path):
    torch.manual_seed(0)
    module = TinyModule(delay=0.02, warmup=1)
    trainer = make_trainer(tmp_path / "pl", max_steps=100_000, val_check_interval=None,
                           check_val_every_n_epoch=None, limit_val_batches=0)
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=loader(16),
                                  run_dir=tmp_path / "run", display=False)
    until(lambda: run.step >= 5, what="step 5")
    run.pause()
    until(lambda: run.state == "paused", what="paused")
    held = trainer.global_step
    time.sleep(0.5)
    assert trainer.global_step == held == run.step
    run.scale_lr(0.5)
    run.checkpoint()
    run.resume()
    until(lambda: (run.events.kind == "checkpoint").any(), what="checkpoint")
    ck = run.events.query("kind == 'checkpoint'").iloc[0]
    assert Path(ck.data["path"]).suffix == ".ckpt" and Path(ck.data["path"]).is_file()
    until(lambda: run.step >= held + 5)
    run.stop()
    run.wait()
    assert run.state == "stopped" and trainer.global_step == run.step < 100_000
    lrs = run.df["lr"].dropna()
    assert lrs.iloc[-1] == pytest.approx(0.5e-3)  # the cut survives LambdaLR
    ours = run.events.query("kind == 'checkpoint'")
    last = ours[[d["reason"] != "Lightning" for d in ours.data]].iloc[-1]
    assert last.data["reason"] == "stop" and Path(last.data["path"]).is_file()
    # Lightning's own resume from nbwatch's checkpoint, and the history goes on
    trainer2 = make_trainer(tmp_path / "pl", max_steps=run.step + 3, limit_val_batches=0,
                            val_check_interval=None, check_val_every_n_epoch=None)
    run2 = nbwatch.lightning.start(trainer2, TinyModule(warmup=1),
                                   train_dataloaders=loader(16), run_dir=tmp_path / "run",
                                   display=False, ckpt_path=last.data["path"])
    run2.wait()
    df = nbwatch.open_run(tmp_path / "run").df.dropna(subset=["loss/train"])
    assert list(df.index) == list(range(1, run.step + 4))


def test_lightnings_own_checkpoints_are_checkpoint_events(tmp_path):
    """Each file a ModelCheckpoint saves is an event at the step it holds, the best marked."""
    import re

    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="val_loss", save_top_k=2,
                         save_last=True, filename="{step}")
    trainer = make_trainer(tmp_path / "pl", max_steps=20, val_check_interval=5,
                           limit_val_batches=2, callbacks=[ck])
    run = nbwatch.lightning.start(trainer, TinyModule(), train_dataloaders=loader(40),
                                  val_dataloaders=loader(4, seed=1), run_dir=tmp_path / "run",
                                  display=False)
    run.wait()
    assert run.state == "finished"
    ev = run.events.query("kind == 'checkpoint'")
    saves = [(r.step, r.data) for r in ev.itertuples() if r.data["reason"] == "Lightning"]
    # every val end saved a step=N file (5, 10, 15, 20), each an event at its step
    by_name = {Path(d["path"]).name: (step, d) for step, d in saves}
    for n in (5, 10, 15, 20):
        assert f"step={n}.ckpt" in by_name, sorted(by_name)
        step, d = by_name[f"step={n}.ckpt"]
        assert step == n and d["bytes"] > 0
    assert all(int(re.search(r"\d+", name).group()) == step
               for name, (step, _) in by_name.items() if name != "last.ckpt")
    # last.ckpt, written over at each save, is an event each time
    assert sum(Path(d["path"]).name == "last.ckpt" for _, d in saves) == 4
    # the best so far is marked, and the best at the end was marked when it was saved
    assert by_name[Path(ck.best_model_path).name][1]["best"]
    assert not by_name["last.ckpt"][1]["best"]
    # the export's checkpoint table says which of them the top-k has deleted since
    from tests.test_export import Page

    page = Page(run.export_html(tmp_path / "a.html").read_text(encoding="utf-8"))
    rows = json.loads(page.scripts["nbw-state"])["report"]["checkpoints"]["rows"]
    on_disk = {p.name for p in (tmp_path / "ck").iterdir()}
    assert len(on_disk) == 3  # the top 2 and last.ckpt
    assert {r[1]: r[6] for r in rows if r[5] == "Lightning"} == {
        name: "yes" if name in on_disk else "deleted" for name in by_name}


class TwoValLoaders(TinyModule):
    def __init__(self):
        super().__init__()
        self.val: dict[int, list[float]] = {}

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        loss = nbwatch.masked_cross_entropy(self.net(batch["input_ids"]), batch["labels"],
                                            batch["mask"])
        self.val.setdefault(dataloader_idx, []).append(loss.item())
        self.log("val_loss", loss)


def test_two_val_dataloaders_give_loss_val_and_each_loaders_loss(tmp_path):
    """Two val dataloaders: Lightning logs `val_loss/dataloader_idx_0` and `_1`; each is
    recorded, and the first is the run's `loss/val` too (there was no `loss/val` at all:
    the dashboard's val curve and the val alerts had nothing)."""
    torch.manual_seed(0)
    module = TwoValLoaders()
    trainer = make_trainer(tmp_path / "pl", max_steps=4, val_check_interval=4)
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=loader(16),
                                  val_dataloaders=[loader(3, seed=1), loader(2, seed=2)],
                                  run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished", run.error
    first, second = (sum(module.val[i]) / len(module.val[i]) for i in (0, 1))
    df = run.df
    assert df["val/loss/dataloader_idx_0"].dropna().tolist() == pytest.approx([first])
    assert df["val/loss/dataloader_idx_1"].dropna().tolist() == pytest.approx([second])
    assert df["loss/val"].dropna().tolist() == pytest.approx([first])


def test_early_stopping_ends_the_run_finished_and_says_so(tmp_path):
    """Lightning's EarlyStopping ends the fit before max_steps: the run is `finished`, and
    an event says EarlyStopping ended it, with Lightning's reason (nothing said why a run
    meant for 20 steps finished at 4)."""
    torch.manual_seed(0)
    stop = L.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=100.0)
    trainer = make_trainer(tmp_path / "pl", max_steps=20, val_check_interval=2,
                           callbacks=[stop])
    run = nbwatch.lightning.start(trainer, TinyModule(), train_dataloaders=loader(16),
                                  val_dataloaders=loader(2, seed=1),
                                  run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished" and run.step == trainer.global_step == 4, run.error
    ev = run.events
    said = ev[ev["message"].str.contains("EarlyStopping ended the fit at step 4")]
    assert len(said) == 1 and said["severity"].tolist() == ["info"], ev.to_string()
    assert "val_loss" in said["message"].iloc[0]


class ManualAccumulation(TinyModule):
    """Manual optimization that accumulates two batches a step, returning each batch's
    own loss (Lightning divides nothing there)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()
        return loss


def test_a_manual_optimizations_accumulated_step_records_its_mean_loss(tmp_path):
    """Two batches a step under manual optimization: the step's loss is their mean (it was
    their sum, as if each returned loss had been divided by the count)."""
    torch.manual_seed(0)
    module = ManualAccumulation()
    trainer = make_trainer(tmp_path / "pl", max_steps=4, limit_val_batches=0)
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=loader(16),
                                  run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished" and run.step == 4, run.error
    pairs = [sum(module.losses[i:i + 2]) / 2 for i in range(0, 8, 2)]
    assert run.df["loss/train"].dropna().tolist() == pytest.approx(pairs, rel=1e-5)


def test_accumulation_and_bf16(tmp_path):
    torch.manual_seed(0)
    module = TinyModule()
    trainer = make_trainer(tmp_path / "pl", max_steps=6, accumulate_grad_batches=2,
                           precision="bf16-mixed", limit_val_batches=0)
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=loader(16),
                                  run_dir=tmp_path / "run", display=False)
    run.wait()
    df = run.df.dropna(subset=["loss/train"])
    assert run.state == "finished" and list(df.index) == list(range(1, 7))
    pairs = [sum(module.losses[i:i + 2]) / 2 for i in range(0, 12, 2)]
    assert df["loss/train"].tolist() == pytest.approx(pairs, rel=1e-5)
    assert df["grad_norm/global"].tolist() == pytest.approx(module.norms, rel=1e-4)


def test_an_epochs_last_shorter_accumulation_step_records_its_mean_loss(tmp_path):
    """16 batches an epoch, 3 a step: the 6th step of each epoch takes one batch, whose
    loss Lightning still divides by 3: the recorded loss is still that step's mean."""
    torch.manual_seed(0)
    module = TinyModule()
    trainer = make_trainer(tmp_path / "pl", max_steps=-1, max_epochs=2,
                           accumulate_grad_batches=3, limit_val_batches=0)
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=loader(16),
                                  run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished" and run.step == 12 == trainer.global_step
    sizes, means, i = [3, 3, 3, 3, 3, 1] * 2, [], 0
    for n in sizes:
        means.append(sum(module.losses[i:i + n]) / n)
        i += n
    assert run.df["loss/train"].dropna().tolist() == pytest.approx(means, rel=1e-5)


def test_a_16_mixed_overflow_is_a_routine_step(tmp_path):
    """16-mixed's GradScaler (on the CPU here) skips the optimizer step of an overflow, which
    Lightning still counts: nbwatch records it as that step's `amp/overflow`, keeps its
    step count with Lightning's, and no rule fires."""
    import contextlib

    from lightning.pytorch.plugins.precision import MixedPrecision

    class Overflows(TinyModule):
        def training_step(self, batch, batch_idx):  # the 2nd and 3rd overflow in fp16
            loss = super().training_step(batch, batch_idx)
            return loss * 1e38 if len(self.losses) in (2, 3) else loss

        def on_before_optimizer_step(self, optimizer):
            pass

    class Fp16(MixedPrecision):  # the scaler as on a GPU, the CPU's float32 math
        def autocast_context_manager(self):
            return contextlib.nullcontext()

    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer = make_trainer(tmp_path / "pl", max_steps=8, limit_val_batches=0,
                           plugins=[Fp16("16-mixed", "cpu", scaler=scaler)])
    run = nbwatch.lightning.start(trainer, Overflows(), train_dataloaders=loader(16),
                                  run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished" and run.step == 8 == trainer.global_step
    assert run.df["amp/overflow"].fillna(0).tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
    assert scaler.get_scale() == 2.0**14
    assert run.events.query("kind == 'alert'").empty


def test_the_callback_alone_in_a_script(tmp_path):
    script = textwrap.dedent("""
        import sys, torch
        import nbwatch.lightning
        from tests.test_lightning import TinyModule, loader, make_trainer
        torch.set_num_threads(1)
        cb = nbwatch.lightning.NbwatchCallback(run_dir=sys.argv[1] + "/run")
        trainer = make_trainer(sys.argv[1] + "/pl", max_steps=8, limit_val_batches=0,
                               callbacks=[cb])
        trainer.fit(TinyModule(), train_dataloaders=loader(16))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    run = nbwatch.open_run(tmp_path / "run")
    assert run.state == "finished" and run.step == 8


def test_adapter_errors_name_the_fix(tmp_path):
    with pytest.raises(TypeError, match="lightning Trainer"):
        nbwatch.lightning.start(object(), TinyModule(), run_dir=tmp_path / "r")
    trainer = make_trainer(tmp_path)
    with pytest.raises(TypeError, match="hist_every= is an option of the run, not of "
                                        r"Trainer.fit\(\): pass monitor="):
        nbwatch.lightning.start(trainer, TinyModule(), loader(8), run_dir=tmp_path / "r",
                                hist_every=5)
    with pytest.raises(TypeError, match="'displya' is no option of the run; did you mean "
                                        "'display'"):
        nbwatch.lightning.NbwatchCallback(tmp_path / "r", displya=False)
    with pytest.raises(TypeError, match=r"'resume' is the framework's to give the run: "
                                        r"trainer.fit\(\.\.\., ckpt_path="):
        nbwatch.lightning.NbwatchCallback(tmp_path / "r", resume=True)
    assert not any(isinstance(c, nbwatch.lightning.NbwatchCallback) for c in trainer.callbacks)
    assert not (tmp_path / "r").exists()
    assert nbwatch.lightning.val_figures({"val_loss": 2.0, "val/acc": 0.5,
                                          "train_loss": 3.0}) == {"loss": 2.0, "acc": 0.5}


def test_without_lightning_the_error_names_the_extra():
    code = ("import sys; sys.modules['lightning'] = None; sys.modules['lightning.pytorch'] = None\n"
            "try:\n    import nbwatch.lightning\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT).stdout
    assert "pip install 'nbwatch[lightning]'" in out


def test_ddp_stop_from_attach_ends_both_ranks_at_one_step(tmp_path, monkeypatch):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    job = nbwatch.launch(ROOT / "tests" / "scripts" / "pl_ddp_train.py", nproc=2,
                         run_dir=run_dir, args=[out], display=False)
    proc = job.process
    try:
        job.wait_started(120)
        until(lambda: job.step >= 12, timeout=120, what="step 12")
        job.scale_lr(0.5)
        job.stop()
        assert proc.wait(timeout=120) == 0, (run_dir / "torchrun.log").read_text()[-3000:]
    finally:
        proc.kill()
        job.close()
    steps = [int((out / f"step_rank{r}.txt").read_text()) for r in (0, 1)]
    run = nbwatch.open_run(run_dir)
    assert run.state == "stopped" and steps[0] == steps[1] == run.step
    df = run.df
    assert run.meta["run"]["world_size"] == 2 and df["rank1/loss"].notna().all()
    assert df["rank0/lr"].tolist() == df["rank1/lr"].tolist()  # the cut on both, at once


@pytest.mark.parametrize("after_start", [False, True])
def test_a_sigterm_ends_the_fit_stopped_with_a_checkpoint_not_finished(tmp_path, after_start):
    """A script's SIGTERM during a fit: Lightning's handler takes it and its loop raises
    `SIGTERMException` (a SystemExit) at the next batch boundary; the run reads `stopped`,
    said why, with a stop checkpoint. That clean-looking exit read `finished`, with none.
    `after_start`: a start() run trained in this script first, whose SIGTERM handler its
    training thread could not unset; Lightning calls it too, and it killed the process."""
    import signal

    from nbwatch.monitor import exiting

    if after_start:
        net = torch.nn.Linear(4, 1)
        mon = nbwatch.Monitor(net, torch.optim.SGD(net.parameters(), lr=0.1),
                              run_dir=tmp_path / "before", display=False)
        mon.start(lambda m, b: m(b).square().mean(), [torch.randn(2, 4)] * 3,
                  max_steps=3).wait()
        assert signal.getsignal(signal.SIGTERM) is exiting._on_sigterm  # left set

    class Term(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 6:
                os.kill(os.getpid(), signal.SIGTERM)

    cb = nbwatch.lightning.NbwatchCallback(tmp_path / "run", display=False)
    trainer = make_trainer(tmp_path, max_steps=20, enable_checkpointing=False,
                           callbacks=[cb, Term()])
    with pytest.raises(SystemExit):
        trainer.fit(TinyModule(), train_dataloaders=loader(16))
    run = nbwatch.open_run(tmp_path / "run")
    assert run.state == "stopped" and run.step == 6
    assert run.meta["stopped_by"] == "terminated by SIGTERM at step 6"
    ckpt = tmp_path / "checkpoints" / "nbwatch-step=6.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 6


def pl_torchrun(run_dir: Path, out: Path, **env: str) -> subprocess.Popen:
    """tests/scripts/pl_ddp_train.py under a real `torchrun --nproc_per_node=2`."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tests" / "scripts" / "pl_ddp_train.py"), str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "NBWATCH_RUN_DIR": str(run_dir),
                       **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigterm_to_the_launcher_stops_a_ddp_fit_with_a_checkpoint_that_resumes(tmp_path):
    """`kill` of torchrun (a scheduler's preemption) under a Lightning DDP fit: Lightning's
    own SIGTERM handler takes it on every rank (its SIGTERMException still reaches the
    user's callbacks), and the run ends `stopped` as a start() or Trainer run does, with a
    stop checkpoint that `fit(ckpt_path=...)` continues, every step once. It read `failed`
    ("the launcher stops the job when a rank fails") with no checkpoint: rank 0 took
    Lightning's SIGTERM for a rank's failure (and without it the fit read `finished`)."""
    from nbwatch.run import RunNotStarted

    def recorded() -> int:
        try:
            return nbwatch.open_run(run_dir).step if (run_dir / "nbwatch.db").exists() else 0
        except RunNotStarted:
            return 0

    for attempt in range(3):
        run_dir, out = tmp_path / f"run{attempt}", tmp_path / f"out{attempt}"
        out.mkdir()
        proc = pl_torchrun(run_dir, out)
        try:
            until(lambda: recorded() >= 15, timeout=120, what="step 15", poll=0.2)
            proc.send_signal(15)
            log, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
        run = nbwatch.open_run(run_dir)
        # Lightning's own race (Lightning-AI/pytorch-lightning#20806): its SIGTERM handler
        # broadcasts from rank 0 inside the handler, and where the signal finds one rank in
        # the backward's all_reduce and the other in that broadcast, both wait until
        # torchrun kills them 30 s on. No process is left to record anything: `stale`. A
        # loaded machine hits it about 1 time in 4; the fit is tried again there.
        if run.state != "stale" or "forcefully exiting via 9" not in log:
            break
    assert run.state == "stopped", log[-3000:]
    assert run.meta["stopped_by"] == f"terminated by SIGTERM at step {run.step}"
    stopped = run.step
    ckpt = out / "checkpoints" / f"nbwatch-step={stopped}.ckpt"
    ev = run.events
    assert ckpt.exists() and ev.message.str.startswith(f"stop checkpoint at step {stopped}").any()
    assert torch.load(ckpt, weights_only=False)["global_step"] == stopped
    # Lightning's own handling: its exception reached the callbacks of both ranks
    assert [(out / f"exception_rank{r}.txt").read_text() for r in (0, 1)] == [
        "SIGTERMException"] * 2
    proc = pl_torchrun(run_dir, out, CKPT_PATH=str(ckpt), MAX_STEPS=str(stopped + 10))
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, log[-3000:]
    run = nbwatch.open_run(run_dir)
    assert run.state == "finished" and run.df.index.tolist() == list(range(1, stopped + 11))
    assert [int((out / f"step_rank{r}.txt").read_text()) for r in (0, 1)] == [stopped + 10] * 2


def test_torchrun_fit_names_its_straggler(tmp_path):
    """Rank 1 of a Lightning DDP fit takes 0.1 s more for each batch (its dataset), and
    the module holds a buffer, which DDP broadcasts from rank 0 as each training forward
    begins: each rank's `time/busy` is recorded, without that wait, and the straggler rule
    names rank 1; the clock's hooks are gone once the fit returned. The clock was on the
    module, inside DDP's wrapper: the fast rank's busy time held its wait for the slow
    one, and neither rank was named."""
    out = tmp_path / "out"
    out.mkdir()
    proc = pl_torchrun(tmp_path / "run", out, SLOW_RANK="1", MAX_STEPS="30")
    log, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, log[-3000:]
    run = nbwatch.open_run(tmp_path / "run")
    df = run.df[["rank0/time/busy", "rank1/time/busy"]]
    assert df.loc[2:].notna().all().all(), df
    busy = df.loc[5:].median()
    assert busy["rank1/time/busy"] > busy["rank0/time/busy"] + 0.05, busy
    said = run.events.message
    assert said.str.startswith("straggler: rank 1").any(), said.tolist()
    assert not said.str.startswith("straggler: rank 0").any(), said.tolist()
    for r in (0, 1):  # as the fit began, at step 10, after it
        began, during, after = map(int, (out / f"hooks_rank{r}.txt").read_text().split())
        assert during > began == after


class ImageModule(L.LightningModule):
    """A classifier on `(x, y)` batches: no mask, no tokens (a ViT's, a CNN's shape)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_batch_without_a_mask_gives_samples_per_second(tmp_path):
    """`(x, y)` batches of 6 images: samples/s is the batch's own size over the step's
    time (it was not recorded: Lightning's adapter counted samples from masks only)."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(6, 3, 4, 4, generator=g), torch.randint(0, 4, (6,), generator=g))
            for _ in range(8)]
    trainer = make_trainer(tmp_path / "pl", max_steps=8, val_check_interval=None,
                           limit_val_batches=0)
    run = nbwatch.lightning.start(trainer, ImageModule(),
                                  train_dataloaders=torch.utils.data.DataLoader(
                                      data, batch_size=None),
                                  run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished", run.error
    df = run.df
    rate = df["throughput/samples_per_s"]
    assert rate.notna().all() and len(rate) == 8
    np.testing.assert_allclose(rate, 6 / df["time/step"], rtol=1e-6)  # stored as float32


class FusedModule(TinyModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def test_a_fused_optimizer_under_16_mixed_is_measured_unscaled(tmp_path):
    """Lightning leaves a fused optimizer's gradients scaled where its callbacks see them
    (the scaler's step unscales inside the optimizer): nbwatch measures them in the
    optimizer's own pre-hook, unscaled. It recorded them ×65,536 (the loss scale), so its
    gradient rules clipped every step to 1/65,536 of the limit."""
    from lightning.pytorch.plugins import MixedPrecision

    torch.manual_seed(0)
    scale = 2.0**16
    trainer = make_trainer(tmp_path / "pl", max_steps=8, val_check_interval=None,
                           limit_val_batches=0, plugins=[MixedPrecision(
                               "16-mixed", "cpu", scaler=torch.amp.GradScaler(
                                   "cpu", init_scale=scale))])
    module = FusedModule()
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=loader(8),
                                  run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished", run.error
    df = run.df
    # the module's hook reads the scaled gradients Lightning hands its callbacks
    np.testing.assert_allclose(df["grad_norm/global"], np.array(module.norms) / scale,
                               rtol=1e-4)
    assert df["grad_norm/clipped"].tolist() == df["grad_norm/global"].tolist()


class T5Module(L.LightningModule):
    """T5 with source and target padded to the same length: the encoder's mask and the
    target's differ. Writes down the log Z figures of its own logits over the target's
    real positions, as nbwatch's hook computes them."""

    def __init__(self):
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                       num_decoder_layers=2, num_heads=4, decoder_start_token_id=0)
        self.model = T5ForConditionalGeneration(cfg)
        self.expected: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        from nbwatch.probes.logit_rows import logit_parts

        out = self.model(**batch)
        self.expected.append([float(t) for t in logit_parts(out.logits.detach(),
                                                             batch["labels"] != -100)])
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def t5_batches(n: int):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 64, (4, 16), generator=g)
        src = torch.arange(16)[None, :] < torch.tensor([[16], [12], [9], [5]])
        labels = torch.randint(1, 64, (4, 16), generator=g)
        tgt = torch.arange(16)[None, :] < torch.tensor([[4], [16], [7], [11]])
        out.append({"input_ids": ids * src, "attention_mask": src.long(),
                    "labels": labels.masked_fill(~tgt, -100)})
    return out


def test_an_encoder_decoders_log_z_is_weighted_by_its_target_mask(tmp_path):
    """T5's logits are the decoder's: `train_logits/*` weight them by the labels' real
    positions, not by the batch's `attention_mask` (the source's), which it took because
    it has the logits' shape."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    module = T5Module()
    trainer = make_trainer(tmp_path / "pl", max_steps=6, val_check_interval=None,
                           limit_val_batches=0)
    run = nbwatch.lightning.start(trainer, module, train_dataloaders=torch.utils.data.DataLoader(
        t5_batches(6), batch_size=None), run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished", run.error
    got = run.df[["train_logits/log_z", "train_logits/max_abs"]]
    assert got.notna().all().all()
    np.testing.assert_allclose(got.to_numpy(), np.array(module.expected), rtol=1e-5)



def test_an_encoder_decoders_data_figures_are_its_sources(tmp_path):
    """A T5's tokens, padding and lengths are its source's (its attention_mask, else every
    input_ids token, as start() and the Trainer count them), never its target's: a batch
    without an attention_mask had none."""
    pytest.importorskip("transformers")
    batches = t5_batches(3)
    src = batches[0]["attention_mask"].sum(dim=1).float()  # 16, 12, 9, 5
    for source in (True, False):
        torch.manual_seed(0)
        data = [b if source else {k: v for k, v in b.items() if k != "attention_mask"}
                for b in batches]
        trainer = make_trainer(tmp_path / f"pl{source}", max_steps=3, val_check_interval=None,
                               limit_val_batches=0)
        run = nbwatch.lightning.start(trainer, T5Module(), train_dataloaders=
                                      torch.utils.data.DataLoader(data, batch_size=None),
                                      run_dir=tmp_path / f"run{source}", display=False)
        run.wait()
        assert run.state == "finished", run.error
        df = run.df
        want = [float(b["attention_mask"].sum()) if source else 64.0 for b in batches]
        assert df["tokens/real"].tolist() == want
        assert df["data/padding_ratio"].tolist() == pytest.approx([1 - w / 64 for w in want])
        assert df["data/seq_len_max"].iloc[0] == (float(src.max()) if source else 16.0)
        assert df["data/seq_len_mean"].iloc[0] == (float(src.mean()) if source else 16.0)


def test_one_callback_given_twice_records_each_step_once(tmp_path):
    """`L.Trainer(callbacks=[cb, cb])`: Lightning calls it twice at each event; the run is
    recorded once, with no error about a fit that "ended without telling nbwatch"."""
    cb = nbwatch.lightning.NbwatchCallback(run_dir=tmp_path / "run")
    trainer = make_trainer(tmp_path / "pl", max_steps=10, callbacks=[cb, cb])
    with pytest.warns(UserWarning, match="given to this Trainer 2 times"):
        trainer.fit(TinyModule(), train_dataloaders=loader(16))
    run = nbwatch.open_run(tmp_path / "run")
    assert (run.state, run.step) == ("finished", 10)
    assert run.df.index.tolist() == list(range(1, 11))
    ev = run.events
    assert not (ev.kind == "error").any(), ev.message.tolist()


class CombinedModule(L.LightningModule):
    """Trains on several loaders' batches at once (Lightning's CombinedLoader: a dict or a
    list of them), text dicts and `[x, y]` pairs; writes down the batches it was given."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 4)
        self.lin = torch.nn.Linear(4, 1)
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch)
        loss = self.lin.bias.sum() * 0
        for part in batch.values() if isinstance(batch, dict) else batch:
            if isinstance(part, dict):
                loss = loss + self.lin(self.emb(part["input_ids"])).square().mean()
            elif isinstance(part, torch.Tensor):
                loss = loss + self.lin(part).square().mean()
            elif part is not None:
                x, y = part
                loss = loss + torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _texts(n: int, width: int, seed: int) -> list[dict]:
    """`n` sequences of 1 to `width` real tokens, padded to `width`."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 50, (width,), generator=g),
             "attention_mask": (torch.arange(width) < n_real).long()}
            for n_real in torch.randint(1, width + 1, (n,), generator=g).tolist()]


def _packed(docs: list[int]) -> dict:
    """One packed row of documents of these lengths (`position_ids` from 0 at each)."""
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    return {"input_ids": torch.ones_like(pos), "position_ids": pos}


def _pairs(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g),
                                          torch.randn(n, generator=g))


def _by_hand(batch) -> tuple[int, list[int], int]:
    """A CombinedLoader step's samples (every loader's rows), its sequences' lengths (each
    text row's real tokens) and its text's positions, counted in plain Python."""
    rows, lengths, width = 0, [], 0
    for part in batch.values() if isinstance(batch, dict) else batch:
        if isinstance(part, dict) and "position_ids" in part:  # packed: its documents
            pos = part["position_ids"][0].tolist()
            starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
            docs = [b - a for a, b in zip(starts, starts[1:])]
            rows, lengths, width = rows + len(docs), lengths + docs, width + len(pos)
        elif isinstance(part, dict):
            rows += len(part["attention_mask"])
            lengths += [sum(r) for r in part["attention_mask"].tolist()]
            width += part["attention_mask"].numel()
        elif isinstance(part, torch.Tensor):
            rows += len(part)
        elif part is not None:
            rows += len(part[0])
    return rows, lengths, width


@pytest.mark.parametrize("mode", ["dict", "min_size", "max_size", "tensors", "packed"])
def test_a_combined_loaders_figures_are_every_loaders(tmp_path, mode):
    """A real fit on a CombinedLoader: a dict of two text loaders (Lightning's default,
    max_size_cycle: the shorter cycles), a list of an `[x, y]` loader and a text loader
    (min_size), a dict of a text loader that runs out (None) and an `[x, y]` one
    (max_size), a dict of two loaders of bare tensors (Lightning's own example: a dict of
    tensors a batch of one loader would be), a packed loader (position_ids, no mask) and
    an `[x, y]` one. Each step's samples are all its loaders' rows (a packed one's
    documents: the `[x, y]` rows were dropped beside them), its tokens, lengths, padding
    and data/seq_len histogram its text loaders', counted by hand from the batches
    training_step got; nbwatch counted the first loader's batch alone (the dicts' tokens
    not at all)."""
    from lightning.pytorch.utilities import CombinedLoader

    def dl(data, batch_size):
        return torch.utils.data.DataLoader(data, batch_size=batch_size)

    loaders = {
        "dict": {"a": dl(_texts(7, 6, 1), 3), "b": dl(_texts(5, 4, 2), 2)},
        "min_size": CombinedLoader([dl(_pairs(5, 3), 2), dl(_texts(6, 5, 4), 4)], "min_size"),
        "max_size": CombinedLoader({"a": dl(_texts(3, 5, 5), 2), "b": dl(_pairs(8, 6), 3)},
                                   "max_size"),
        "tensors": CombinedLoader({"a": dl(torch.randn(6, 4), 4), "b": dl(torch.randn(15, 4), 5)},
                                  "max_size_cycle"),
        "packed": {"a": dl([_packed([3, 2, 4]), _packed([5, 1]), _packed([2, 2, 2, 3])], None),
                   "b": dl(_pairs(15, 7), 5)},
    }[mode]
    torch.manual_seed(0)
    module = CombinedModule()
    cb = nbwatch.lightning.NbwatchCallback(run_dir=tmp_path / "run", hist_every=1)
    make_trainer(tmp_path / "pl", max_steps=-1, max_epochs=1, val_check_interval=None,
                 limit_val_batches=0, callbacks=[cb]).fit(module, train_dataloaders=loaders)
    run = nbwatch.open_run(tmp_path / "run")
    df = run.df
    counts = [_by_hand(b) for b in module.seen]
    assert len(counts) == {"dict": 3, "min_size": 2, "max_size": 3, "tensors": 3,
                           "packed": 3}[mode]
    assert df.index.tolist() == list(range(1, len(counts) + 1))
    samples = (df["throughput/samples_per_s"] * df["time/step"]).round().astype(int)
    assert samples.tolist() == [rows for rows, _, _ in counts]
    for step, (_, lengths, width) in enumerate(counts, start=1):
        row = df.loc[step]
        if not lengths:  # max_size's last step: its text loader ran out
            assert np.isnan(row.get("tokens/real", np.nan))
            assert np.isnan(row.get("data/seq_len_mean", np.nan))
            continue
        assert row["tokens/real"] == sum(lengths)
        assert row["data/seq_len_mean"] == pytest.approx(sum(lengths) / len(lengths))
        assert row["data/seq_len_max"] == max(lengths)
        assert row["data/padding_ratio"] == pytest.approx(1 - sum(lengths) / width)
    texts = [(s, ls) for s, (_, ls, _) in enumerate(counts, start=1) if ls]
    if not texts:  # no tokens: no histogram
        assert samples.tolist() == [4 + 5, 2 + 5, 4 + 5] and "tokens/real" not in df
        return
    at, edges, hist = run.histograms("data/seq_len")
    assert at.tolist() == [s for s, _ in texts]
    for (_, ls), e, c in zip(texts, edges, hist, strict=True):
        assert c.sum() == len(ls) and (np.histogram(ls, bins=e)[0] == c).all()
    if mode == "max_size":
        assert module.seen[-1]["a"] is None  # the shape it names: a loader run out


@pytest.mark.parametrize("mode", ["pairs_and_text", "list_of_one", "beside_packed"])
def test_a_loaders_batch_in_parts_counts_its_parts_tokens_and_its_rows(tmp_path, mode):
    """A loader whose batches come in parts (a reward model's {"chosen", "rejected"} of 3
    rows) in a fit's collection of loaders: beside a text loader (2 rows), alone in a
    list (`train_dataloaders=[dl]`), beside a packed loader (3 documents) and an `(x, y)`
    one (5 rows). Each part's tokens count, as with one loader (27 the pair's), and the
    pair's rows once: 3 + 2 samples, 27 + 12 tokens; 3 + 5 + 3 beside the packed one. The
    pair's tokens were dropped (12 tokens; none at all for the list of one)."""
    def tok(n, width):
        return {"input_ids": torch.ones(n, width, dtype=torch.long),
                "attention_mask": torch.ones(n, width, dtype=torch.long)}

    def dl(batches):
        return torch.utils.data.DataLoader(batches, batch_size=None)

    pairs = dl([{"chosen": tok(3, 5), "rejected": tok(3, 4)}] * 3)
    packed = {"input_ids": torch.ones(1, 9, dtype=torch.long),
              "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])}
    xy = (torch.randn(5, 4), torch.randn(5))
    loaders = {"pairs_and_text": {"pref": pairs, "sft": dl([tok(2, 6)] * 3)},
               "list_of_one": [pairs],
               "beside_packed": {"a": dl([packed] * 3), "b": dl([xy] * 3), "c": pairs}}[mode]

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.lin.weight.square().sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = nbwatch.lightning.NbwatchCallback(run_dir=tmp_path / "run")
    make_trainer(tmp_path / "pl", max_steps=3, val_check_interval=None, limit_val_batches=0,
                 callbacks=[cb]).fit(Module(), train_dataloaders=loaders)
    df = nbwatch.open_run(tmp_path / "run").df
    samples = (df["throughput/samples_per_s"] * df["time/step"]).round().astype(int)
    want = {"pairs_and_text": (3 + 2, 15 + 12 + 12), "list_of_one": (3, 15 + 12),
            "beside_packed": (3 + 5 + 3, 9 + 15 + 12)}[mode]
    assert samples.tolist() == [want[0]] * 3
    assert df["tokens/real"].tolist() == [want[1]] * 3
