"""`nbwatch.hf`: a real `transformers.Trainer` on a tiny GPT-2 built from a config (no
download), synthetic padded data (labels −100 on pads), watched and steered by nbwatch."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import nbwatch  # noqa: E402
import nbwatch.hf  # noqa: E402
from nbwatch.adapters.hf import val_set  # noqa: E402
from nbwatch.interrupts import Terminated  # noqa: E402
from nbwatch.lifecycle import LIVE  # noqa: E402
from tests.conftest import until  # noqa: E402
from tests.scripts import wide_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def padded(n: int, seed: int) -> wide_run.Padded:
    """Token sequences of 6 to 32 tokens, right-padded to 32, labels −100 on the pads."""
    return wide_run.Padded(n, seed, vocab=64, shortest=6)


def slow_collate(delay: float):
    def collate(items):
        time.sleep(delay)
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}
    return collate


def tiny_model(arch: str = "gpt2", attn: str = "sdpa"):
    """A 2-layer, 2-head model of a Hugging Face architecture, built from its config."""
    import transformers as tf

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=64,
                            bos_token_id=0, eos_token_id=0, attn_implementation=attn)
        return tf.GPT2LMHeadModel(cfg)
    if arch == "bert":
        cfg = tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, vocab_size=64, attn_implementation=attn)
        return tf.BertForMaskedLM(cfg)
    if arch != "t5":
        raise ValueError(f"tiny_model makes gpt2, bert or t5, not {arch!r}")
    cfg = tf.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=64,
                      decoder_start_token_id=0, pad_token_id=0, attn_implementation=attn)
    return tf.T5ForConditionalGeneration(cfg)


def make_trainer(out: Path, max_steps: int = 20, delay: float = 0.0, model=None, **args):
    from transformers import Trainer, TrainingArguments

    kw = dict(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
              per_device_eval_batch_size=4, logging_steps=1, report_to=[], save_strategy="no",
              eval_strategy="steps", eval_steps=10, learning_rate=1e-3, warmup_steps=3,
              use_cpu=True, disable_tqdm=True, seed=0, log_level="error")
    kw.update(args)
    return Trainer(model=model if model is not None else tiny_model(),
                   args=TrainingArguments(**kw),
                   train_dataset=padded(64, 0), eval_dataset=padded(8, 1),
                   data_collator=slow_collate(delay) if delay else None)


def trainer_log(trainer, key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


def test_recorded_figures_equal_the_trainers_own_log(tmp_path):
    trainer = make_trainer(tmp_path / "out")
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    assert run.state in LIVE  # returned at once: the fit trains on in its thread
    run.wait()
    assert run.state == "finished" and run.step == 20
    df = run.df
    assert list(df.dropna(subset=["loss/train"]).index) == list(range(1, 21))
    for key, ours in (("loss", "loss/train"), ("grad_norm", "grad_norm/global"),
                      ("learning_rate", "lr"), ("eval_loss", "loss/val")):
        theirs = trainer_log(trainer, key)
        assert theirs, key
        for step, v in theirs.items():
            assert df.loc[step, ours] == pytest.approx(v, rel=1e-5, abs=1e-9), (key, step)
    assert df["loss/gap"].notna().sum() == 2
    per_layer = [c for c in df if c.startswith("grad_norm/transformer.h.")]
    assert len(per_layer) >= 8  # ln, attn, mlp modules of both blocks
    # padding from the batches' attention masks
    assert df["data/padding_ratio"].between(0.0, 0.9).all() and df["tokens/real"].gt(0).all()
    maps = nbwatch.open_run(tmp_path / "run").attention(step=20)
    assert sorted(maps) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    w = next(iter(maps.values()))
    assert w.shape[0] == 2 and float(w[0][0, 1:].sum()) == pytest.approx(0.0)  # causal rows
    assert "transformers" not in subprocess.run(
        [sys.executable, "-c", "import nbwatch, sys; print(sorted(sys.modules))"],
        capture_output=True, text=True, cwd=ROOT).stdout  # import nbwatch stays light


def test_an_eval_dataset_dict_records_each_sets_metrics_not_their_timings(tmp_path):
    """`eval_dataset={"a": ..., "b": ...}`: the Trainer evaluates each set under its own
    prefix (`eval_a_loss`, `eval_a_runtime`, …). Each set's metrics are recorded, its
    timings are not (they were: `val/a_runtime`, `val/a_samples_per_second`, …)."""
    trainer = make_trainer(tmp_path / "out", max_steps=4, eval_steps=2)
    trainer.eval_dataset = {"a": padded(4, 1), "b": padded(4, 2)}
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished", run.error
    val = sorted(c for c in run.df if c.startswith("val/"))
    assert val == ["val/a_loss", "val/b_loss"], val
    for key in ("eval_a_loss", "eval_b_loss"):
        for step, v in trainer_log(trainer, key).items():
            assert run.df.loc[step, "val/" + key[5:]] == pytest.approx(v, rel=1e-6)
    # the first set's loss is the run's loss/val (its gap, val alerts, best checkpoint);
    # it had none
    df = run.df.dropna(subset=["loss/val"])
    assert df.index.tolist() == [2, 4] and (df["loss/val"] == df["val/a_loss"]).all()
    assert df["loss/gap"].notna().all()
    assert val_set(SimpleNamespace(metric_for_best_model="eval_b_loss"), {"a": 1, "b": 2}) == "b"
    assert val_set(SimpleNamespace(metric_for_best_model=None), {"a": 1, "b": 2}) == "a"


def test_the_trainers_reduce_lr_on_plateau_is_the_runs_scheduler(tmp_path):
    """`lr_scheduler_type="reduce_lr_on_plateau"`: the Trainer steps it at its evals, with
    the eval loss. Its cuts are the run's own (each used to fire lr_change, "not by the
    scheduler"), and the LR recorded is the Trainer's."""
    trainer = make_trainer(tmp_path / "out", max_steps=40, learning_rate=1e-2, warmup_steps=0,
                           lr_scheduler_type="reduce_lr_on_plateau",
                           lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "threshold": 10})
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished", run.error
    lr = run.df["lr"]
    assert lr.nunique() >= 3, lr.drop_duplicates()  # no eval beats the best by 10×: cuts
    for step, v in trainer_log(trainer, "learning_rate").items():
        assert lr[step] == pytest.approx(v, rel=1e-9), step
    assert not run.events.message.str.contains("LR changed").any(), run.events.message


def test_pause_cut_lr_checkpoint_stop_through_the_trainer(tmp_path):
    out = tmp_path / "out"
    trainer = make_trainer(out, max_steps=10_000, delay=0.02, eval_steps=10_000)
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    until(lambda: run.step >= 5, what="step 5")
    run.pause()
    until(lambda: run.state == "paused", what="paused")
    held = trainer.state.global_step
    time.sleep(0.5)
    assert trainer.state.global_step == held == run.step  # the Trainer itself is frozen
    run.scale_lr(0.5)
    run.checkpoint()
    run.resume()
    until(lambda: (run.events.kind == "checkpoint").any(), what="checkpoint")
    ck = run.events.query("kind == 'checkpoint'").iloc[0]
    assert Path(ck.data["path"]).name == f"checkpoint-{ck.step}"
    assert (Path(ck.data["path"]) / "trainer_state.json").is_file()  # the Trainer's own
    until(lambda: run.step >= held + 5, what="steps after resume")
    run.stop()
    run.wait()
    assert run.state == "stopped" and trainer.state.global_step == run.step < 10_000
    df = run.df
    theirs = trainer_log(trainer, "learning_rate")  # the Trainer's own: the cut LR it used
    cut = int(run.events.query(
        "kind == 'action' and message.str.startswith('LR scaled')").step.iloc[0])
    after = [s for s in theirs if s > cut]
    assert after and all(df.loc[s, "lr"] == pytest.approx(theirs[s]) for s in after)
    assert df.loc[cut + 1, "lr"] == pytest.approx(0.5 * df.loc[cut, "lr"], rel=1e-3)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        trainer.lr_scheduler.get_last_lr()[0])
    last = run.events.query("kind == 'checkpoint'").iloc[-1]
    assert last.data["reason"] == "stop" and last.step == run.step
    # the framework's checkpoint resumes the framework's way, and the history goes on
    trainer2 = make_trainer(out, max_steps=run.step + 3, eval_steps=10_000)
    run2 = nbwatch.hf.start(trainer2, run_dir=tmp_path / "run", display=False,
                            resume_from_checkpoint=last.data["path"])
    run2.wait()
    df2 = nbwatch.open_run(tmp_path / "run").df.dropna(subset=["loss/train"])
    assert list(df2.index) == list(range(1, run.step + 4))


@pytest.mark.parametrize("strategy", ["epoch", "steps"])
def test_the_trainers_checkpoint_never_runs_ahead_of_the_store(tmp_path, strategy):
    """When the Trainer writes checkpoint-N (each epoch, or every 16 steps), the run
    folder on disk holds step N already: a process that dies then resumes with no hole."""
    from transformers import TrainerCallback

    seen = []

    class Peek(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            df = nbwatch.open_run(tmp_path / "run").df
            seen.append((state.global_step, int(df["loss/train"].dropna().index.max())))

    trainer = make_trainer(tmp_path / "out", max_steps=-1, num_train_epochs=2,
                           eval_strategy="no", save_strategy=strategy, save_steps=16)
    trainer.add_callback(Peek())
    nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False).wait()
    assert seen == [(16, 16), (32, 32)]


def test_the_callback_alone_records_an_error_in_the_optimizer_step(tmp_path):
    """A notebook cell's `trainer.train()` with the callback: the optimizer's step raising
    (a CUDA OOM as Adam allocates its state, say) fails the run and lets go of its folder,
    while the kernel lives on."""
    from nbwatch.store import check_no_writer

    trainer = make_trainer(tmp_path / "out", max_steps=10, eval_steps=1000)
    trainer.add_callback(nbwatch.hf.NbwatchCallback(run_dir=tmp_path / "run"))
    trainer.create_optimizer()
    steps = []

    def hook(opt, args, kwargs):
        steps.append(1)
        if len(steps) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    trainer.optimizer.register_step_pre_hook(hook)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()
    run = nbwatch.open_run(tmp_path / "run")
    assert run.state == "failed" and run.step == 2
    assert run.events.query("kind == 'error'").message.str.contains("out of memory").any()
    check_no_writer(tmp_path / "run")  # raises while a writer holds the folder


@pytest.mark.parametrize("stop", [KeyboardInterrupt, Terminated], ids=["ctrl-c", "sigterm"])
def test_the_callback_alone_checkpoints_a_ctrl_c(tmp_path, stop):
    """Interrupt kernel during a notebook cell's `trainer.train()` with the callback: the
    run is stopped (not failed), and a Trainer checkpoint of the last step taken is
    written, which `train(resume_from_checkpoint=...)` continues. A script's SIGTERM
    (`Terminated`; under torchrun, the launcher's) too: it wrote none."""
    trainer = make_trainer(tmp_path / "out", max_steps=10, eval_steps=1000)
    trainer.add_callback(nbwatch.hf.NbwatchCallback(run_dir=tmp_path / "run"))
    loss, calls = trainer.compute_loss, []

    def compute_loss(*a, **k):
        calls.append(1)
        if len(calls) == 4:  # in the 4th step's forward
            raise stop() if stop is KeyboardInterrupt else stop("terminated by SIGTERM")
        return loss(*a, **k)

    trainer.compute_loss = compute_loss
    with pytest.raises(stop):
        trainer.train()
    run = nbwatch.open_run(tmp_path / "run")
    assert run.state == "stopped" and run.step == 3
    ckpt = tmp_path / "out" / "checkpoint-3"
    assert (ckpt / "trainer_state.json").is_file()
    saved = run.events[run.events.kind == "checkpoint"]
    assert list(saved.step) == [3] and saved.message.str.contains("checkpoint-3").all()
    del trainer.compute_loss
    trainer.train(resume_from_checkpoint=str(ckpt))
    run = nbwatch.open_run(tmp_path / "run")
    assert run.state == "finished" and list(run.df.index) == list(range(1, 11))


def test_a_ctrl_c_after_the_optimizers_step_writes_no_mislabelled_checkpoint(tmp_path):
    """A Ctrl-C after the optimizer stepped, before the Trainer counted the step: its
    checkpoint would hold step 4's weights as checkpoint-3, and a resume would train step 4
    twice. None is written, and the events say why."""
    from transformers import TrainerCallback

    trainer = make_trainer(tmp_path / "out", max_steps=10, eval_steps=1000)
    trainer.add_callback(nbwatch.hf.NbwatchCallback(run_dir=tmp_path / "run"))
    steps = []

    def interrupt(opt, args, kwargs):
        steps.append(1)
        if len(steps) == 4:
            raise KeyboardInterrupt

    class After(TrainerCallback):  # its post-hook runs after nbwatch's
        def on_train_begin(self, args, state, control, optimizer=None, **kw):
            optimizer.optimizer.register_step_post_hook(interrupt)

    trainer.add_callback(After())
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    run = nbwatch.open_run(tmp_path / "run")
    assert run.state == "stopped" and run.step == 4
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    assert run.events.message.str.contains("no checkpoint").any()


def oom_above(trainer, batch: int, at=None) -> None:
    """The Trainer's loss runs out of memory (a simulated CUDA OOM) on batches larger than
    `batch`: at each of its calls numbered in `at` (1 for the first), or at every call."""
    loss, calls = trainer.compute_loss, []

    def compute_loss(model, inputs, *a, **k):
        calls.append(1)
        if inputs["input_ids"].shape[0] > batch and (at is None or len(calls) in at):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return loss(model, inputs, *a, **k)

    trainer.compute_loss = compute_loss


@pytest.mark.parametrize("how", ["start", "callback"])
def test_auto_find_batch_size_retries_into_the_same_run(tmp_path, how):
    """`auto_find_batch_size=True`: an OOM makes the Trainer begin the fit again at 0.9×
    the batch. nbwatch records the retries in the same run, drops the failed try's steps,
    says so in the events, and writes no emergency checkpoint for a try the Trainer redoes."""
    trainer = make_trainer(tmp_path / "out", max_steps=6, per_device_train_batch_size=6,
                           auto_find_batch_size=True, eval_strategy="no")
    oom_above(trainer, 4, at=range(4, 99))  # the first try (batch 6) fails at its 4th step
    if how == "start":
        nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False).wait()
    else:
        trainer.add_callback(nbwatch.hf.NbwatchCallback(run_dir=tmp_path / "run"))
        trainer.train()
    run = nbwatch.open_run(tmp_path / "run")
    assert run.state == "finished" and run.step == 6
    assert list(run.df.index) == [1, 2, 3, 4, 5, 6]  # the last try's steps, once each
    ref = trainer_log(trainer, "loss")
    assert np.allclose([run.df["loss/train"][s] for s in ref], list(ref.values()), rtol=1e-4)
    notes = run.events[run.events.message.str.contains("auto_find_batch_size")].message
    assert [m.split(" ran out")[0] for m in notes] == ["the try at batch size 6",
                                                       "the try at batch size 5"]
    assert "the 3 steps of that try were dropped" in notes.iloc[0]
    assert "began the fit again at batch size 4" in notes.iloc[1]
    assert not (run.events.kind == "checkpoint").any()
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_auto_find_batch_size_that_gives_up_leaves_a_failed_run(tmp_path):
    """Every batch size runs out of memory at last: the fit raises, the run reads failed
    with the OOM, and the next fit with the same callback (a new fit, not a retry) may not
    write over it."""
    trainer = make_trainer(tmp_path / "out", max_steps=4, per_device_train_batch_size=2,
                           auto_find_batch_size=True, eval_strategy="no")
    oom_above(trainer, 0, at={3, 5})  # batch 2: steps 1-2, OOM; batch 1: step 1, OOM
    cb = nbwatch.hf.NbwatchCallback(run_dir=tmp_path / "run")
    trainer.add_callback(cb)
    with pytest.raises(RuntimeError, match="No executable batch size"):
        trainer.train()
    run = nbwatch.open_run(tmp_path / "run")
    assert run.state == "failed" and run.step == 1
    assert run.events.query("kind == 'error'").message.str.contains("out of memory").all()
    del trainer.compute_loss
    with pytest.raises(FileExistsError, match="already holds a run at step 1"):
        trainer.train()


def fp16_on_cpu(trainer):
    """The Trainer's accelerator given a GradScaler, as fp16 on a GPU has (on the CPU: the
    same scaling, unscaling and overflow skips)."""
    from nbwatch.adapters.base import unwrap

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer.accelerator.scaler = scaler
    trainer.accelerator.unscale_gradients = lambda optimizer=None: scaler.unscale_(
        unwrap(trainer.optimizer, "optimizer"))
    return scaler


def test_fp16_norms_are_the_true_ones_and_an_overflow_is_routine(tmp_path):
    """fp16: the gradients are still scaled (×65536) where the Trainer is about to clip;
    nbwatch measures them unscaled, as the Trainer's own grad_norm; its clip rule acts on
    true norms; and an overflow (the scaler skips the step while its scale comes down) is
    recorded as `amp/overflow`, not a non-finite gradient that pauses the run."""
    trainer = make_trainer(tmp_path / "out", max_steps=6, eval_steps=1000,
                           logging_nan_inf_filter=False)
    scaler = fp16_on_cpu(trainer)
    losses = trainer.compute_loss

    def compute_loss(*a, **k):  # the 2nd and 3rd steps overflow in fp16
        loss = losses(*a, **k)
        return loss * 1e38 if trainer.state.global_step in (1, 2) else loss

    trainer.compute_loss = compute_loss
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    run.wait()
    assert run.state == "finished" and run.step == 6 == trainer.state.global_step
    df = run.df
    assert df["amp/overflow"].fillna(0).tolist() == [0, 1, 1, 0, 0, 0]
    assert scaler.get_scale() == 2.0**14  # halved at each overflow
    theirs = trainer_log(trainer, "grad_norm")
    for step in (1, 4, 5, 6):
        assert df.loc[step, "grad_norm/global"] == pytest.approx(theirs[step], rel=1e-5)
    assert (df["grad_norm/clipped"].dropna() <= 1.0 + 1e-6).all()
    assert run.events.query("kind == 'alert'").empty


def test_gradient_accumulation_and_bf16(tmp_path):
    trainer = make_trainer(tmp_path / "out", max_steps=6, gradient_accumulation_steps=2,
                           bf16=True, eval_steps=3)
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    run.wait()
    df = run.df
    assert run.state == "finished" and len(df.dropna(subset=["loss/train"])) == 6
    for step, v in trainer_log(trainer, "loss").items():
        assert df.loc[step, "loss/train"] == pytest.approx(v, rel=1e-5)
    for step, v in trainer_log(trainer, "grad_norm").items():
        assert df.loc[step, "grad_norm/global"] == pytest.approx(v, rel=1e-4)


def test_the_callback_alone_in_a_script(tmp_path):
    """A script: `callbacks=[NbwatchCallback(...)]`, `trainer.train()` in the foreground,
    a failure recorded with its traceback."""
    script = textwrap.dedent("""
        import sys, torch
        import nbwatch.hf
        from tests.test_hf import make_trainer
        torch.set_num_threads(1)
        trainer = make_trainer(sys.argv[1] + "/out", max_steps=8)
        trainer.add_callback(nbwatch.hf.NbwatchCallback(run_dir=sys.argv[1] + "/run"))
        trainer.train()
        if sys.argv[2] == "fail":
            trainer2 = make_trainer(sys.argv[1] + "/out2", max_steps=8)
            trainer2.add_callback(nbwatch.hf.NbwatchCallback(run_dir=sys.argv[1] + "/run2"))
            trainer2.compute_loss = lambda *a, **k: 1 / 0
            trainer2.train()
    """)
    subprocess.run([sys.executable, "-c", script, str(tmp_path), "fail"], cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                   timeout=300)
    ok = nbwatch.open_run(tmp_path / "run")
    assert ok.state == "finished" and ok.step == 8
    failed = nbwatch.open_run(tmp_path / "run2")
    assert failed.state == "failed"
    assert "ZeroDivisionError" in " ".join(failed.events.message)


@pytest.mark.parametrize("how", ["train", "start"])
def test_one_callback_given_twice_records_each_step_once(tmp_path, how):
    """`callbacks=[cb, cb]`, or a cell run twice that adds the same callback again: the
    Trainer calls it twice at each event; the run is still recorded once."""
    trainer = make_trainer(tmp_path / "out", max_steps=10, eval_steps=5)
    cb = nbwatch.hf.NbwatchCallback(run_dir=tmp_path / "run")
    trainer.add_callback(cb)
    trainer.add_callback(cb)  # what Trainer(callbacks=[cb, cb]) does too
    with pytest.warns(UserWarning, match="given to this Trainer 2 times"):
        if how == "train":
            trainer.train()
        else:
            nbwatch.hf.start(trainer, display=False).wait()
    run = nbwatch.open_run(tmp_path / "run")
    assert (run.state, run.step) == ("finished", 10)
    assert run.df.index.tolist() == list(range(1, 11))
    assert run.df["loss/val"].dropna().index.tolist() == [5, 10]
    ev = run.events
    assert not (ev.kind == "error").any(), ev.message.tolist()
    assert not ev.message.str.contains("lr_change|without telling").any()


@pytest.mark.parametrize("arch,attn", [("gpt2", "eager"), ("bert", "sdpa"), ("t5", "eager"),
                                       ("t5", "sdpa")])
def test_attention_maps_of_every_attention_module(tmp_path, arch, attn):
    trainer = make_trainer(tmp_path / "out", max_steps=2, eval_steps=2,
                           model=tiny_model(arch, attn))
    nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False).wait()
    maps = nbwatch.open_run(tmp_path / "run").attention(step=2)
    if arch == "gpt2":
        assert sorted(maps) == ["transformer.h.0.attn", "transformer.h.1.attn"]
        assert float(maps["transformer.h.0.attn"][0][0, 1:].sum()) == pytest.approx(0.0)
    elif arch == "bert":
        assert sorted(maps) == [f"bert.encoder.layer.{i}.attention.self" for i in (0, 1)]
    else:
        cross = [m for m in maps if "EncDecAttention" in m]
        assert len(cross) == 2 and len(maps) == 6  # encoder self, decoder self, cross × 2
        assert all(w.shape[0] == 2 for w in maps.values())
        assert maps[cross[0]].shape[-2:] == (32, 32)  # labels (decoder) × inputs (encoder)
        run = nbwatch.open_run(tmp_path / "run")
        for sample in (0, 1):  # weights, not T5's position bias beside them: rows sum to 1
            got = run.attention(step=2, sample=sample)
            assert len(got) == 6
            for m in cross:
                np.testing.assert_allclose(got[m].sum(-1), 1.0, atol=2e-2)
    page = nbwatch.export_html(tmp_path / "run", tmp_path / "run.html").read_text()
    assert all(m in page for m in maps)  # every module's map is in the panel


def test_adapter_errors_name_the_fix(tmp_path):
    with pytest.raises(TypeError, match="transformers.Trainer"):
        nbwatch.hf.start(object(), run_dir=tmp_path / "r")
    # a run's option given to start() as the Trainer's, or misspelt: refused at the call,
    # not in the fit's thread once it began; nothing is added to the Trainer
    trainer = make_trainer(tmp_path / "out")
    with pytest.raises(TypeError, match=r"alerts= is an option of the run, not of "
                                        r"Trainer.train\(\): pass monitor=\{'alerts'"):
        nbwatch.hf.start(trainer, run_dir=tmp_path / "r", alerts={"plateau": False})
    if not any(p.kind is p.VAR_KEYWORD  # transformers 4's train(**kwargs) refuses itself
               for p in inspect.signature(trainer.train).parameters.values()):
        with pytest.raises(TypeError, match="Trainer.train\\(\\) would refuse"):
            nbwatch.hf.start(trainer, run_dir=tmp_path / "r", resume_from=True)
    with pytest.raises(TypeError, match=r"'max_steps' is the framework's to give the run: "
                                        r"TrainingArguments\(max_steps="):
        nbwatch.hf.start(trainer, run_dir=tmp_path / "r", monitor={"max_steps": 5})
    with pytest.raises(TypeError, match="'hist_evry' is no option of the run; did you mean "
                                        "'hist_every'"):
        nbwatch.hf.start(trainer, run_dir=tmp_path / "r", monitor={"hist_evry": 5})
    with pytest.raises(TypeError, match="'alertz' is no option"):
        nbwatch.hf.NbwatchCallback(tmp_path / "r", alertz={})
    assert not any(isinstance(c, nbwatch.hf.NbwatchCallback)
                   for c in trainer.callback_handler.callbacks)
    assert not (tmp_path / "r").exists()
    assert nbwatch.hf.eval_figures({"eval_loss": 2.0, "eval_accuracy": 0.5,
                                    "eval_runtime": 0.1, "epoch": 1.0}) == {
        "loss": 2.0, "accuracy": 0.5}


def hf_torchrun(cwd: Path, out: Path, *launcher: str, **env: str
                ) -> subprocess.CompletedProcess:
    """tests/scripts/hf_ddp_train.py on 2 ranks for 40 steps into `out` (made), with `env`
    (its faults) and torchrun's options `launcher`, and no NBWATCH_RUN_DIR: each rank's
    callback names its own folder."""
    out.mkdir()
    base = {k: v for k, v in os.environ.items() if k != "NBWATCH_RUN_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         *launcher, str(ROOT / "tests" / "scripts" / "hf_ddp_train.py"), str(out), "40"],
        cwd=cwd, env={**base, "PYTHONPATH": str(ROOT), **env},
        capture_output=True, text=True, timeout=300)


def test_torchrun_callback_without_run_dir_records_one_folder_for_both_ranks(tmp_path):
    """`NbwatchCallback()` made on each rank of a torchrun job, rank 1's a second and a half
    after rank 0's, which then fails: its default folder was named by its own clock, so
    its error report went where rank 0 never looked ("lost contact with another rank").
    Both use rank 0's folder now, and the run names rank 1's error. Rank 0 writes the
    Trainer's emergency checkpoint, which resumes: its save's FLOs sum over the ranks (an
    all_gather) failed on the closed connection, and no event said so."""
    out = tmp_path / "out"
    done = hf_torchrun(tmp_path, out, BREAK_RANK1_AT="7")
    assert done.returncode != 0
    (folder,) = (tmp_path / "runs").iterdir()
    run = nbwatch.open_run(folder)
    assert run.state == "failed" and run.meta["run"]["world_size"] == 2
    error = run.events[run.events.kind == "error"].message.iloc[-1]
    assert "rank 1 broke at step 7" in error, error
    saved = run.events[run.events.kind == "checkpoint"].message
    assert saved.str.startswith(f"emergency checkpoint at step {run.step}: "
                                f"checkpoint-{run.step}").any(), run.events.message.tolist()
    assert (out / f"checkpoint-{run.step}" / "model.safetensors").is_file()


def test_emergency_checkpoint_keeps_the_trainers_best_step(tmp_path):
    """One process whose fit failed on an error that reads like a lost peer (a streamed
    dataset's HTTP read: 'Read timed out'): its emergency checkpoint was written as if
    another rank had died, with no best step (`best_global_step` null in its
    trainer_state.json, 3 before). A lost peer is a torchrun job's alone, and the
    checkpoint written without collectives keeps the Trainer's best step too."""
    import json

    from nbwatch.adapters.hf_internals import save_checkpoint_now

    calls = {"n": 0}

    def collate(items):
        calls["n"] += 1
        if calls["n"] == 10:  # (the loader reads one batch ahead; the eval's are two)
            raise RuntimeError("Read timed out. (read timeout=10)")
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}

    trainer = make_trainer(tmp_path / "out", eval_steps=3, save_strategy="steps",
                           save_steps=3, metric_for_best_model="eval_loss")
    trainer.data_collator = collate
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    with pytest.raises(RuntimeError, match="timed out"):
        run.wait()
    assert run.state == "failed" and run.step > 3
    state = json.loads((tmp_path / "out" / f"checkpoint-{run.step}"
                        / "trainer_state.json").read_text())
    assert state["best_global_step"] == 3, state
    trainer.state.global_step += 1  # the torchrun job's save, its peer lost
    path = save_checkpoint_now(trainer, alone=True)
    assert json.loads((path / "trainer_state.json").read_text())["best_global_step"] == 3
    assert trainer.state.best_global_step == 3


def test_torchrun_trainer_names_its_straggler(tmp_path):
    """Rank 1 of a Trainer's job takes 0.1 s more before each forward (its data): each
    rank's `time/busy` is recorded and the straggler rule names rank 1. The Trainer under
    torchrun recorded no busy time, so the rule never fired there; then rank 0's wait in
    DDP's broadcast of the model's buffer, before the model's forward, was its busy time."""
    done = hf_torchrun(tmp_path, tmp_path / "out", SLOW_RANK1="0.1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (folder,) = (tmp_path / "runs").iterdir()
    run = nbwatch.open_run(folder)
    busy = run.df[["rank0/time/busy", "rank1/time/busy"]].loc[5:].median()
    assert busy["rank1/time/busy"] > busy["rank0/time/busy"] + 0.05, busy
    said = run.events.message
    assert said.str.startswith("straggler: rank 1").any(), said.tolist()
    assert not said.str.startswith("straggler: rank 0").any(), said.tolist()


def test_torchrun_trainer_whose_rank_0_died_leaves_no_checkpoint_of_rank_1s_alone(tmp_path):
    """Rank 0 killed at step 7 (the OOM killer, a lost node): rank 1, its peer lost, wrote
    the Trainer's emergency checkpoint without collectives, which on a rank that does not
    save is its RNG state alone: out/checkpoint-7/ held rng_state_1.pth and no weights, and
    `train(resume_from_checkpoint=True)` took that folder (the newest) and failed. The
    checkpoint without collectives is rank 0's alone now: no folder."""
    out = tmp_path / "out"
    # torchrun looks at its workers every 3 s, not every 0.1: rank 1 meets the closed
    # connection before the launcher's SIGTERM (which came first in one CI run of 2026-12-07)
    done = hf_torchrun(tmp_path, out, "--monitor-interval=3", KILL_RANK0_AT="7")
    assert done.returncode != 0
    assert "Connection" in done.stdout + done.stderr  # rank 1 lost its peer
    assert not list(out.glob("checkpoint-*")), [str(p) for p in out.rglob("*")]


def test_torchrun_trainer_stop_from_attach_ends_both_ranks_at_one_step(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    script = ROOT / "tests" / "scripts" / "hf_ddp_train.py"
    env_before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT)
    try:
        job = nbwatch.launch(script, nproc=2, run_dir=run_dir, args=[out], display=False)
    finally:
        if env_before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_before
    proc = job.process
    try:
        job.wait_started(120)
        until(lambda: job.step >= 12, timeout=120, what="step 12")
        job.stop()
        assert proc.wait(timeout=120) == 0, (run_dir / "torchrun.log").read_text()[-3000:]
    finally:
        proc.kill()
        job.close()
    steps = [int((out / f"step_rank{r}.txt").read_text()) for r in (0, 1)]
    run = nbwatch.open_run(run_dir)
    assert run.state == "stopped" and steps[0] == steps[1] == run.step
    assert run.meta["run"]["world_size"] == 2
    df = run.df
    assert df["rank0/loss"].notna().all() and df["rank1/loss"].notna().all()
    stop = run.events.query("kind == 'action' and message.str.startswith('stop')").step.iloc[0]
    assert stop % 5 == 0  # taken at an exchange step, by both ranks


def test_without_transformers_the_error_names_the_extra():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import nbwatch.hf\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT).stdout
    assert "pip install 'nbwatch[hf]'" in out
