"""The controls under a real `transformers.Trainer` (issue 21, items 7, 8, 10): Checkpoint
while paused writes the Trainer's own checkpoint during the pause; after Cut LR the
Trainer's own logged `learning_rate` (what W&B or TensorBoard callbacks record beside
nbwatch) is the LR the optimizer used; a model without an attention mask (a ViT) gets
samples/s. Tiny models built from configs, no downloads (tests/test_hf.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

transformers = pytest.importorskip("transformers")

import nbwatch  # noqa: E402
import nbwatch.hf  # noqa: E402
from tests.conftest import until  # noqa: E402
from tests.test_hf import make_trainer, padded  # noqa: E402


class Beside(transformers.TrainerCallback):
    """Another callback of the Trainer's (as W&B's or TensorBoard's): what it is told."""

    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}
        self.saves: list[int] = []

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "learning_rate" in logs:
            self.lrs[state.global_step] = logs["learning_rate"]

    def on_save(self, args, state, control, **kw):
        self.saves.append(state.global_step)


def checkpoints(run) -> list:
    return [r for r in run.events.itertuples() if r.kind == "checkpoint"]


def test_checkpoint_while_paused_is_written_during_the_pause_and_resumes(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    beside = Beside()
    trainer = make_trainer(out, max_steps=10_000, delay=0.02, eval_steps=10_000)
    trainer.add_callback(beside)
    run = nbwatch.hf.start(trainer, run_dir=run_dir, display=False)
    until(lambda: run.step >= 3, what="step 3")
    run.pause()
    until(lambda: run.state == "paused", what="paused")
    held = trainer.state.global_step
    run.checkpoint()
    until(lambda: checkpoints(run), what="the checkpoint event, while paused")
    path = out / f"checkpoint-{held}"
    # on disk now, the Trainer's own (model, optimizer, scheduler, RNG, trainer state),
    # while the Trainer is still frozen at the step it paused at
    assert run.state == "paused" and trainer.state.global_step == held == run.step
    for name in ("trainer_state.json", "optimizer.pt", "scheduler.pt", "model.safetensors"):
        assert (path / name).is_file(), name
    assert json.loads((path / "trainer_state.json").read_text())["global_step"] == held
    ck = checkpoints(run)[0]
    assert ck.step == held and ck.data["reason"] == "manual"
    assert Path(ck.data["path"]) == path and ck.data["bytes"] > 0 and ck.data["seconds"] > 0
    assert beside.saves == [held]  # the Trainer's save event, to every callback
    run.stop()  # still paused: the fit ends at the step of that checkpoint
    run.wait()
    assert run.state == "stopped" and run.step == held == trainer.state.global_step
    assert len(checkpoints(run)) == 1 and beside.saves == [held]  # not written again
    # the Trainer's way back: resume_from_checkpoint, and the run's history goes on
    trainer2 = make_trainer(out, max_steps=held + 3, eval_steps=10_000)
    run2 = nbwatch.hf.start(trainer2, run_dir=run_dir, display=False,
                            resume_from_checkpoint=str(path))
    run2.wait()
    assert run2.state == "finished" and trainer2.state.global_step == held + 3
    df = nbwatch.open_run(run_dir).df.dropna(subset=["loss/train"])
    assert list(df.index) == list(range(1, held + 4))


def test_checkpoint_while_running_is_written_at_the_step_it_is_taken(tmp_path):
    """Not paused: the same save, at the step the command is taken, written once."""
    out = tmp_path / "out"
    beside = Beside()
    trainer = make_trainer(out, max_steps=10_000, delay=0.02, eval_steps=10_000)
    trainer.add_callback(beside)
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    until(lambda: run.step >= 2, what="step 2")
    run.checkpoint()
    until(lambda: checkpoints(run), what="the checkpoint event")
    ck = checkpoints(run)[0]
    assert Path(ck.data["path"]) == out / f"checkpoint-{ck.step}"
    assert (out / f"checkpoint-{ck.step}" / "trainer_state.json").is_file()
    run.stop()
    run.wait()
    assert beside.saves.count(ck.step) == 1


def test_trainers_logged_learning_rate_after_cut_lr_is_the_lr_used(tmp_path):
    beside = Beside()
    trainer = make_trainer(tmp_path / "out", max_steps=10_000, delay=0.02,
                           eval_steps=10_000)
    trainer.add_callback(beside)
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    until(lambda: run.step >= 5, what="step 5")
    run.scale_lr(0.5)
    cut = until(lambda: [r.step for r in run.events.itertuples()
                         if r.kind == "action" and r.message.startswith("LR scaled")],
                what="the LR cut")[0]
    until(lambda: run.step >= cut + 5, what="steps after the cut")
    run.stop()
    run.wait()
    df = run.df
    theirs = {h["step"]: h["learning_rate"] for h in trainer.state.log_history
              if "learning_rate" in h}
    after = [s for s in theirs if s > cut]
    assert len(after) >= 4
    for s, lr in theirs.items():  # the LR each step used, before and after the cut
        assert lr == pytest.approx(df.loc[s, "lr"], rel=1e-6), s
        assert beside.lrs[s] == lr  # what a W&B or TensorBoard callback records
    # the cut took: half the schedule (which moves ~1e-4 a step here)
    assert df.loc[cut + 1, "lr"] == pytest.approx(0.5 * df.loc[cut, "lr"], rel=1e-3)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        trainer.lr_scheduler.get_last_lr()[0])


@pytest.mark.parametrize("fp16", [False, True])
def test_after_clip_the_trainers_grad_norm_is_still_the_norm_before_clipping(tmp_path, fp16):
    """nbwatch's Clip acts before the Trainer's own clip, which then measured the clipped
    gradients: the Trainer logged `grad_norm` = the Clip's limit at every step after it
    (and so did TensorBoard or W&B beside it). It logs the norm before any clip, nbwatch's
    `grad_norm/global`, as it does before the Clip."""
    from tests.test_hf import fp16_on_cpu

    trainer = make_trainer(tmp_path / "out", max_steps=10_000, delay=0.02,
                           eval_steps=10_000, max_grad_norm=1.0)
    if fp16:
        fp16_on_cpu(trainer)
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    until(lambda: run.step >= 3, what="step 3")
    run.set_clip(0.01)
    until(lambda: (run.df.get("grad_norm/clipped", pd.Series([], dtype=float)) < 0.02).sum() >= 3,
          what="clipped steps")
    run.stop()
    run.wait()
    df = run.df
    clipped = df.index[df["grad_norm/clipped"] < 0.02]
    theirs = {h["step"]: h["grad_norm"] for h in trainer.state.log_history
              if "grad_norm" in h}
    assert set(clipped) <= set(theirs)
    for s in clipped:
        assert df.loc[s, "grad_norm/global"] > 0.1  # the Clip cut these steps
        assert theirs[s] == pytest.approx(df.loc[s, "grad_norm/global"], rel=1e-5), s


# -- throughput of a model without an attention mask ------------------------------------
class Images(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


class Unmasked(torch.utils.data.Dataset):
    """Token sequences with no attention mask: every token is real."""

    def __init__(self, n: int, seed: int):
        self.items = [{"input_ids": it["input_ids"], "labels": it["input_ids"]}
                      for it in padded(n, seed).items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def tiny_vit():
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=2,
                                 num_attention_heads=2, hidden_size=32, intermediate_size=64,
                                 num_labels=3)
    return transformers.ViTForImageClassification(cfg)


def plain_trainer(out: Path, model, train, evaluate=None, **args):
    kw = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=4,
              per_device_eval_batch_size=4, logging_steps=1, report_to=[],
              save_strategy="no", eval_strategy="steps" if evaluate else "no", eval_steps=4,
              learning_rate=1e-3, use_cpu=True, disable_tqdm=True, seed=0, log_level="error")
    kw.update(args)
    return transformers.Trainer(model=model, args=transformers.TrainingArguments(**kw),
                                train_dataset=train, eval_dataset=evaluate)


def test_vit_under_the_trainer_gets_samples_per_second(tmp_path):
    trainer = plain_trainer(tmp_path / "out", tiny_vit(), Images(32, 0), Images(8, 1),
                            gradient_accumulation_steps=2)
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False).wait()
    assert run.state == "finished"
    df = run.df.dropna(subset=["loss/train"])
    assert list(df.index) == [1, 2, 3, 4]
    rate = df["throughput/samples_per_s"]
    assert rate.notna().all() and (rate > 0).all()
    # two micro-batches of 4 images a step: samples/s × step time is the step's 8 images
    assert (rate * df["time/step"]).tolist() == pytest.approx([8.0] * 4)
    assert "throughput/tokens_per_s" not in df or df["throughput/tokens_per_s"].isna().all()
    assert "loss/val" in run.df  # the eval of a vision model goes on as before


def test_tokens_without_an_attention_mask_are_all_real(tmp_path):
    from tests.test_hf import tiny_model

    trainer = plain_trainer(tmp_path / "out", tiny_model(), Unmasked(16, 0), max_steps=3)
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False).wait()
    df = run.df.dropna(subset=["loss/train"])
    assert (df["tokens/real"] == 4 * 32).all() and (df["data/padding_ratio"] == 0).all()
    assert (df["throughput/tokens_per_s"] > 0).all()
    assert (df["throughput/samples_per_s"] * df["time/step"]).tolist() == pytest.approx(
        [4.0] * 3)


def test_checkpoint_that_cannot_be_written_fails_the_run_naming_why(tmp_path):
    """A fault in the Trainer's save under a pause (its output folder is now a file): the
    fit fails with the Trainer's own error, and the run reads failed, naming it."""
    import shutil

    out = tmp_path / "out"
    trainer = make_trainer(out, max_steps=10_000, delay=0.02, eval_steps=10_000)
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    until(lambda: run.step >= 2, what="step 2")
    run.pause()
    until(lambda: run.state == "paused", what="paused")
    shutil.rmtree(out, ignore_errors=True)
    out.write_text("not a folder")
    run.checkpoint()
    with pytest.raises(OSError):
        run.wait(timeout=60)
    failed = nbwatch.open_run(tmp_path / "run")
    assert failed.state == "failed"
    assert any("Error" in m and f"checkpoint-{failed.step}" in m
               for m in failed.events.message)
