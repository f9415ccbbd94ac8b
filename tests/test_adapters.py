"""The framework adapters refuse what they cannot carry (issue 20): one fit per Trainer and
per callback at a time, a callback used again only once its fit ended, a failed fit gives
back all it took; and what they take from transformers and Lightning beyond the public
callbacks, checked against the installed releases so that a change fails here by name.

Real tiny Trainers (tests/test_hf.py, tests/test_lightning.py), no downloads."""

from __future__ import annotations

import inspect
import sys
import threading

import pytest
import torch

import nbwatch
from tests.conftest import until


def hf():
    pytest.importorskip("transformers")
    import nbwatch.hf
    from tests import test_hf
    return nbwatch.hf, test_hf


def pl():
    pytest.importorskip("lightning.pytorch")
    import nbwatch.lightning
    from tests import test_lightning
    return nbwatch.lightning, test_lightning


def nbwatch_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("nbwatch"))


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# -- one fit at a time ------------------------------------------------------------------
def test_hf_second_start_while_the_fit_runs_is_refused_and_the_first_goes_on(tmp_path):
    nh, th = hf()
    trainer = th.make_trainer(tmp_path / "out", max_steps=10_000, delay=0.02,
                              eval_steps=10_000)
    run = nh.start(trainer, run_dir=tmp_path / "a", display=False)
    until(lambda: run.step >= 3, what="step 3")
    threads = nbwatch_threads()
    with pytest.raises(RuntimeError, match="already running") as e:
        nh.start(trainer, run_dir=tmp_path / "b", display=False)
    msg = one_line(e)
    assert str(tmp_path / "a") in msg and "wait()" in msg and "stop()" in msg
    assert not (tmp_path / "b").exists() and nbwatch_threads() == threads  # nothing taken
    held = run.step
    until(lambda: run.step >= held + 3, what="the first fit going on")
    assert run.state == "running"
    run.stop()  # its handle still steers it
    run.wait()
    assert run.state == "stopped" and trainer.state.global_step == run.step
    df = nbwatch.open_run(tmp_path / "a").df.dropna(subset=["loss/train"])
    assert list(df.index) == list(range(1, run.step + 1))  # every step, recorded once


def test_lightning_second_start_while_the_fit_runs_is_refused_and_the_first_goes_on(
        tmp_path):
    nl, tl = pl()
    torch.manual_seed(0)
    module = tl.TinyModule(delay=0.02)
    trainer = tl.make_trainer(tmp_path / "pl", max_steps=100_000, val_check_interval=None,
                              limit_val_batches=0)
    run = nl.start(trainer, module, train_dataloaders=tl.loader(16), run_dir=tmp_path / "a",
                   display=False)
    until(lambda: run.step >= 3, what="step 3")
    threads = nbwatch_threads()
    with pytest.raises(RuntimeError, match="already running") as e:
        nl.start(trainer, module, train_dataloaders=tl.loader(16), run_dir=tmp_path / "b",
                 display=False)
    msg = one_line(e)
    assert str(tmp_path / "a") in msg and "wait()" in msg and "stop()" in msg
    assert not (tmp_path / "b").exists() and nbwatch_threads() == threads
    held = run.step
    until(lambda: run.step >= held + 3, what="the first fit going on")
    run.stop()
    run.wait()
    assert run.state == "stopped" and trainer.global_step == run.step
    assert nbwatch.open_run(tmp_path / "a").state == "stopped"


def test_hf_callback_given_to_two_trainers_is_refused_while_its_fit_runs(tmp_path):
    nh, th = hf()
    cb = nh.NbwatchCallback(run_dir=tmp_path / "run")
    first = th.make_trainer(tmp_path / "a", max_steps=10_000, delay=0.02, eval_steps=10_000)
    # built before the first trains: TrainingArguments resets accelerate's process-wide
    # AcceleratorState, which a Trainer training meanwhile reads (transformers' own limit)
    second = th.make_trainer(tmp_path / "b", max_steps=3, eval_steps=10_000)
    first.add_callback(cb)
    second.add_callback(cb)
    run = nh.start(first, display=False)  # the Trainer's own callback records it
    until(lambda: run.step >= 2, what="step 2")
    threads = nbwatch_threads()
    with pytest.raises(RuntimeError, match="already records a fit running") as e:
        second.train()  # the callback alone, in the foreground
    assert str(tmp_path / "run") in one_line(e) and "own NbwatchCallback" in str(e.value)
    with pytest.raises(RuntimeError, match="already records a fit running"):
        nh.start(second, display=False)
    assert nbwatch_threads() == threads and second.state.global_step == 0
    assert "training_step" not in second.__dict__  # its Trainer untouched
    held = run.step
    until(lambda: run.step >= held + 3, what="the first fit going on")
    run.stop()
    run.wait()
    df = nbwatch.open_run(tmp_path / "run").df.dropna(subset=["loss/train"])
    assert run.state == "stopped" and list(df.index) == list(range(1, run.step + 1))


def test_lightning_callback_given_to_two_trainers_is_refused_while_its_fit_runs(tmp_path):
    nl, tl = pl()
    torch.manual_seed(0)
    cb = nl.NbwatchCallback(run_dir=tmp_path / "run")
    first = tl.make_trainer(tmp_path / "a", max_steps=100_000, val_check_interval=None,
                            limit_val_batches=0, callbacks=[cb])
    run = nl.start(first, tl.TinyModule(delay=0.02), train_dataloaders=tl.loader(16),
                   display=False)
    until(lambda: run.step >= 2, what="step 2")
    second = tl.make_trainer(tmp_path / "b", max_steps=3, limit_val_batches=0, callbacks=[cb])
    with pytest.raises(RuntimeError, match="already records a fit running") as e:
        second.fit(tl.TinyModule(), train_dataloaders=tl.loader(4))
    assert str(tmp_path / "run") in one_line(e)
    held = run.step
    until(lambda: run.step >= held + 3, what="the first fit going on")
    run.stop()
    run.wait()
    assert run.state == "stopped" == nbwatch.open_run(tmp_path / "run").state


def test_hf_callback_used_again_after_its_fit_ended(tmp_path):
    """Safe once its fit ended: the next fit is a continuation of its run (a new Trainer
    resuming from the Trainer's checkpoint); a fresh fit over that run is refused, naming
    the way out, before anything is taken."""
    nh, th = hf()
    out, run_dir = tmp_path / "out", tmp_path / "run"
    cb = nh.NbwatchCallback(run_dir=run_dir)
    first = th.make_trainer(out, max_steps=3, eval_steps=10_000, save_strategy="steps",
                            save_steps=3)
    first.add_callback(cb)
    first.train()
    assert nbwatch.open_run(run_dir).state == "finished"
    threads = nbwatch_threads()
    with pytest.raises(FileExistsError, match="already holds a run at step 3") as e:
        nh.start(first, display=False)  # train() again from step 0, over the run
    assert "resume_from_checkpoint" in one_line(e) and nbwatch_threads() == threads
    second = th.make_trainer(out, max_steps=5, eval_steps=10_000)
    second.add_callback(cb)
    second.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    run = nbwatch.open_run(run_dir)
    assert run.state == "finished" and run.step == 5
    df = run.df.dropna(subset=["loss/train"])  # the losses of the new Trainer's steps
    assert list(df.index) == [1, 2, 3, 4, 5]
    assert not {"training_step", "_clip_grad_norm"} & (set(first.__dict__) |
                                                       set(second.__dict__))


def test_hf_start_refuses_the_trainers_callback_that_would_ignore_its_run_dir(tmp_path):
    nh, th = hf()
    trainer = th.make_trainer(tmp_path / "out", max_steps=2)
    trainer.add_callback(nh.NbwatchCallback(run_dir=tmp_path / "mine"))
    with pytest.raises(ValueError, match="would ignore the run_dir=") as e:
        nh.start(trainer, run_dir=tmp_path / "other", display=False)
    assert "trainer.remove_callback(cb)" in one_line(e)
    assert not (tmp_path / "other").exists() and not (tmp_path / "mine").exists()


# -- a failed fit gives back all it took -------------------------------------------------
def broken_collate(items):
    raise ValueError("broken collate")


@pytest.mark.parametrize("how,where", [("callback", "step"), ("callback", "data"),
                                       ("callback", "eval"), ("start", "step")])
def test_hf_fit_failing_at_once_gives_back_everything(tmp_path, how, where):
    """A fit that raises in its first training step (its first batch, its first eval):
    the run reads failed, with the error; no thread of it is left, and its writer lock is
    given back."""
    nh, th = hf()
    run_dir = tmp_path / "run"
    trainer = th.make_trainer(tmp_path / "out", max_steps=5, eval_steps=10_000,
                              eval_on_start=where == "eval")
    error = ValueError if where == "data" else ZeroDivisionError
    if where == "step":
        trainer.compute_loss = lambda *a, **k: 1 / 0
    elif where == "data":
        trainer.data_collator = broken_collate
    else:
        trainer.compute_metrics = lambda prediction: 1 / 0
    if how == "callback":
        trainer.add_callback(nh.NbwatchCallback(run_dir=run_dir))
        with pytest.raises(error):
            trainer.train()
    else:
        handle = nh.start(trainer, run_dir=run_dir, display=False)
        with pytest.raises(error):
            handle.wait()
    assert nbwatch_threads() == []  # the store's writer and the system sampler too
    failed = nbwatch.open_run(run_dir)
    assert failed.state == "failed" and error.__name__ in " ".join(failed.events.message)
    # the folder's writer lock was given back: a new fit writes the same run_dir
    again = nh.start(th.make_trainer(tmp_path / "out2", max_steps=2, eval_steps=10_000),
                     run_dir=run_dir, display=False).wait()
    assert again.state == "finished" and nbwatch.open_run(run_dir).step == 2


def test_hf_fit_that_failed_unseen_is_closed_when_its_callback_begins_again(tmp_path):
    """A failure the Trainer passes to no callback and no guard of the adapter sees (here:
    another callback's, as the fit begins, before its epoch loop): the callback's next fit
    closes the last one's run first."""
    nh, th = hf()
    from transformers import TrainerCallback

    class Raises(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            raise RuntimeError("a callback of the user's")

    run_dir = tmp_path / "run"
    cb = nh.NbwatchCallback(run_dir=run_dir)
    trainer = th.make_trainer(tmp_path / "out", max_steps=3, eval_steps=10_000)
    trainer.add_callback(cb)
    trainer.add_callback(Raises())
    with pytest.raises(RuntimeError, match="a callback of the user's"):
        trainer.train()
    again = th.make_trainer(tmp_path / "out2", max_steps=2, eval_steps=10_000)
    again.add_callback(cb)
    again.train()
    run = nbwatch.open_run(run_dir)
    assert run.state == "finished" and run.step == 2
    assert run.events.message.str.contains("ended without telling nbwatch").any()
    assert nbwatch_threads() == []


# -- what the adapters take from transformers beyond its callbacks -----------------------
def test_transformers_clip_grad_norm_is_where_the_gradients_are_read_before_clipping(
        tmp_path):
    nh, th = hf()
    from transformers import Trainer

    sig = inspect.signature(Trainer._clip_grad_norm)
    assert list(sig.parameters) == ["self", "model"], (
        f"transformers {sys.modules['transformers'].__version__} changed "
        f"Trainer._clip_grad_norm{sig}: nbwatch.hf.wrap_clip_grad_norm wraps it as "
        "_clip_grad_norm(model)")
    trainer = th.make_trainer(tmp_path / "out", max_steps=3, eval_steps=10_000,
                              max_grad_norm=1e-3, gradient_accumulation_steps=2)
    seen: list[tuple[int, float]] = []

    def before() -> None:
        grads = [p.grad.norm() for p in trainer.model.parameters() if p.grad is not None]
        seen.append((trainer.state.global_step,
                     float(torch.linalg.vector_norm(torch.stack(grads)))))

    nh.wrap_clip_grad_norm(trainer, before)
    trainer.train()
    assert [s for s, _ in seen] == [0, 1, 2], (
        "Trainer._clip_grad_norm is no longer called once per optimizer step: "
        "nbwatch.hf.wrap_clip_grad_norm measures there")
    theirs = th.trainer_log(trainer, "grad_norm")  # the Trainer's own pre-clip norm
    for step, norm in seen:
        assert norm == pytest.approx(theirs[step + 1], rel=1e-4), (
            "Trainer._clip_grad_norm no longer runs after backward and before clipping")
    assert all(norm > 1e-3 for _, norm in seen)  # unclipped yet


def test_transformers_runs_each_epoch_through_its_epoch_loop(tmp_path):
    nh, th = hf()
    from transformers import Trainer

    from nbwatch.adapters.hf_internals import PRIVATE_STEPS

    epoch_loop = PRIVATE_STEPS[-1]
    for name in PRIVATE_STEPS:  # each private step nbwatch guards is there
        assert callable(getattr(Trainer, name, None)), name
    assert callable(getattr(Trainer, epoch_loop, None)), (
        f"transformers {sys.modules['transformers'].__version__} has no "
        f"Trainer.{epoch_loop}: nbwatch.hf guards it to see every error of a step")
    trainer = th.make_trainer(tmp_path / "out", max_steps=-1, num_train_epochs=2,
                              eval_strategy="no")
    epochs = []
    run_epoch = getattr(trainer, epoch_loop)

    def counted(*a, **k):
        epochs.append(trainer.state.global_step)
        return run_epoch(*a, **k)

    setattr(trainer, epoch_loop, counted)
    trainer.train()
    assert epochs == [0, 16], (
        f"Trainer.{epoch_loop} is no longer looked up on the Trainer once per epoch: "
        "nbwatch.hf guards it there")


def test_transformers_save_checkpoint_writes_a_folder_train_resumes_from(tmp_path):
    nh, th = hf()
    from transformers import Trainer

    sig = inspect.signature(Trainer._save_checkpoint)
    assert list(sig.parameters)[:3] == ["self", "model", "trial"], (
        f"transformers {sys.modules['transformers'].__version__} changed "
        f"Trainer._save_checkpoint{sig}: nbwatch.hf.save_checkpoint_now calls it as "
        "_save_checkpoint(model, trial=None)")
    out = tmp_path / "out"
    trainer = th.make_trainer(out, max_steps=2, eval_steps=10_000)
    trainer.train()
    path = nh.save_checkpoint_now(trainer)
    assert path == out / "checkpoint-2" and (path / "trainer_state.json").is_file(), (
        f"Trainer._save_checkpoint no longer writes {path}")
    resumed = th.make_trainer(out, max_steps=3, eval_steps=10_000)
    resumed.train(resume_from_checkpoint=str(path))
    assert resumed.state.global_step == 3


def test_transformers_frames_and_attention_implementation(tmp_path):
    nh, th = hf()
    from transformers import TrainerCallback

    found = []

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            found.append(nh.calling_trainer())

    trainer = th.make_trainer(tmp_path / "out", max_steps=1, eval_steps=10_000)
    trainer.add_callback(Probe())
    trainer.train()
    assert found == [trainer], ("nbwatch.hf.calling_trainer (sys._getframe) no longer finds "
                                "the Trainer that calls its callbacks")
    assert nh.calling_trainer() is None
    for attn in ("eager", "sdpa"):
        assert nh.attention_implementation(th.tiny_model("gpt2", attn)) == attn, (
            "PretrainedConfig._attn_implementation changed: nbwatch.hf.attention_"
            "implementation reads it to ask eager attention for its weights")


def test_transformers_logs_the_schedulers_last_lr_which_nbwatch_sets_after_a_cut(
        tmp_path):
    nh, th = hf()
    from transformers import TrainerCallback

    from nbwatch.adapters.base import unwrap

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (n + 1))
    nh.set_last_lr(sched, [0.25])
    assert sched.get_last_lr() == [0.25], (
        f"torch {torch.__version__}: LRScheduler.get_last_lr() no longer returns "
        "_last_lr, which nbwatch.hf.set_last_lr sets after an LR cut")
    opt.step()
    sched.step()
    assert sched.get_last_lr() == [0.5] and sched.base_lrs == [1.0], (
        "LRScheduler.step() no longer sets _last_lr anew from the schedule")

    class Cut(TrainerCallback):  # what nbwatch.hf does at the end of a step after a cut
        def on_step_end(self, args, state, control, lr_scheduler=None, **kw):
            if state.global_step == 1:
                nh.set_last_lr(unwrap(lr_scheduler, "scheduler"), [0.125])

    saves = []

    class Saves(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            saves.append(state.global_step)

    trainer = th.make_trainer(tmp_path / "out", max_steps=2, eval_steps=10_000)
    trainer.add_callback(Cut())
    trainer.add_callback(Saves())
    trainer.train()
    assert th.trainer_log(trainer, "learning_rate")[2] == 0.125, (
        f"transformers {sys.modules['transformers'].__version__}: the Trainer no longer "
        "logs lr_scheduler.get_last_lr() (read after the optimizer step, before "
        "scheduler.step()) as the step's learning_rate; nbwatch.hf.set_last_lr relies on it")
    path = nh.save_checkpoint_now(trainer, announce=True)
    assert (path / "trainer_state.json").is_file() and saves == [2], (
        "trainer.callback_handler.on_save(args, state, control) no longer tells the "
        "callbacks of a save: nbwatch.hf.save_checkpoint_now(announce=True) calls it")


def test_auto_find_batch_size_begins_the_fit_again_at_a_smaller_batch(tmp_path):
    nh, th = hf()
    from transformers import TrainerCallback

    begun = []

    class Begins(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            begun.append(nh.train_batch_size(nh.calling_trainer()))

    trainer = th.make_trainer(tmp_path / "out", max_steps=1, per_device_train_batch_size=4,
                              auto_find_batch_size=True, eval_strategy="no")
    th.oom_above(trainer, 3, at={1})
    trainer.add_callback(Begins())
    trainer.train()
    assert begun == [4, 3], (
        f"transformers {sys.modules['transformers'].__version__}: under auto_find_batch_size "
        f"the Trainer's train_begin events saw batch sizes {begun}, not [4, 3] "
        "(Trainer._train_batch_size, then 0.9× it after an OOM, the fit begun again): "
        "nbwatch.hf tells a retry from a new fit by them")
    assert nh.retries_at_smaller_batch(trainer, torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB")), (
        "accelerate.utils.memory.should_reduce_batch_size no longer takes a CUDA OOM")


# -- what the adapters take from Lightning beyond its callbacks --------------------------
def test_lightning_trainer_state_says_a_fit_runs(tmp_path):
    nl, tl = pl()
    import lightning.pytorch as lp

    seen = []

    class Probe(lp.Callback):
        def on_train_start(self, trainer, module):
            seen.append(nl.fit_running(trainer))

    trainer = tl.make_trainer(tmp_path / "pl", max_steps=1, limit_val_batches=0,
                              callbacks=[Probe()])
    assert not nl.fit_running(trainer)
    trainer.fit(tl.TinyModule(), train_dataloaders=tl.loader(2))
    assert seen == [True] and not nl.fit_running(trainer), (
        "Trainer.state.status no longer reads TrainerStatus.RUNNING during a fit: "
        "nbwatch.lightning.fit_running relies on it")


# -- the interface the adapters use: no private attribute of nbwatch's Monitor or recorder


def _privates_of_the_core() -> set[str]:
    """The private attribute names of a Monitor with an open run and of its recorder."""
    import ast as _ast

    from nbwatch.demo import TinyGPT

    model = TinyGPT(vocab=16, d=8, layers=1, heads=1, ctx=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nbwatch.Monitor(model, opt, run_dir=_tmp_run_dir(), display=False)
    x = torch.randint(0, 16, (2, 4))
    model(x).float().mean().backward()
    opt.step()
    mon.log(loss=torch.tensor(1.0))
    rec = mon._session.recorder
    parts = [v for v in vars(mon).values() if type(v).__module__.startswith("nbwatch.monitor")]
    names = set(vars(mon)) | set(vars(rec)) | {n for p in parts for n in vars(p)}
    for cls in (*type(mon).__mro__, *type(rec).__mro__, *(type(p) for p in parts)):
        names |= set(vars(cls))
        src = inspect.getsource(cls) if cls.__module__.startswith("nbwatch") else ""
        for node in _ast.walk(_ast.parse(src)) if src else ():  # attributes set in methods
            if isinstance(node, _ast.Attribute) and isinstance(node.ctx, _ast.Store):
                names.add(node.attr)
    mon.close()
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _tmp_run_dir():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp()) / "run"


def test_adapters_use_no_private_attribute_of_the_monitor_or_the_recorder():
    """The HF and Lightning adapters drive a fit through `Monitor.open_external` and its
    `ExternalLoop` alone: a private of the core read from the outside (`mon._recorder`,
    `rec._taking`) would break silently when the core changes."""
    import ast as _ast
    from pathlib import Path

    core = _privates_of_the_core()
    pkg = Path(nbwatch.__file__).parent
    found = []
    for name in ("adapters/base.py", "adapters/hf.py", "adapters/lightning.py"):
        tree = _ast.parse((pkg / name).read_text())
        for node in _ast.walk(tree):
            if (isinstance(node, _ast.Attribute) and node.attr in core
                    # the adapter's own (an Adapter keeps its own `_commands`)
                    and not (isinstance(node.value, _ast.Name)
                             and node.value.id in ("self", "cb"))):
                found.append(f"{name}:{node.lineno} .{node.attr}")
    assert {"_session", "_setup", "_thread"} <= core and len(core) > 20  # the scan sees them
    assert not found, f"adapters reach into the core: {found}"
