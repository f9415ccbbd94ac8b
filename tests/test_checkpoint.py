import random

import numpy as np
import pytest
import torch

from nbwatch.checkpoint import Checkpointer, CheckpointError, load, rng_state, set_rng_state


def state(model):
    return {"model": model.state_dict(), "rng": rng_state()}


def test_rotation_keeps_last_n_and_best_apart(tmp_path):
    model = torch.nn.Linear(3, 2)
    ck = Checkpointer(tmp_path / "ck", keep_last=2)
    for step, val in [(10, 3.0), (20, 1.0), (30, 2.0), (40, 2.5)]:
        saved = ck.save(state(model), step, val)
        assert saved.bytes > 0 and saved.seconds >= 0
    assert [s for s, _ in ck.steps()] == [30, 40]
    best = load(tmp_path / "ck" / "best.pt")
    assert best["step"] == 20 and best["val_loss"] == 1.0
    assert ck.latest().name == "step_00000040.pt"
    assert not list((tmp_path / "ck").glob(".*tmp*"))


def test_loads_with_weights_only_and_restores_rngs(tmp_path):
    model = torch.nn.Linear(3, 2)
    ck = Checkpointer(tmp_path)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    ck.save(state(model), 1)
    draws = (torch.rand(1).item(), random.random(), np.random.rand())
    obj = torch.load(ck.latest(), weights_only=True)  # what a user would do
    torch.nn.Linear(3, 2).load_state_dict(obj["model"])
    set_rng_state(obj["rng"])
    assert (torch.rand(1).item(), random.random(), np.random.rand()) == draws


def test_corrupt_checkpoint_names_the_file_and_the_fix(tmp_path):
    bad = tmp_path / "step_00000005.pt"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match="step_00000005.pt cannot be read.*delete it"):
        load(bad)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(1)}, other)
    with pytest.raises(CheckpointError, match="not an nbwatch checkpoint"):
        load(other)


def test_a_resumed_run_keeps_the_earlier_best(tmp_path):
    model = torch.nn.Linear(3, 2)
    Checkpointer(tmp_path).save(state(model), 10, val_loss=1.0)
    resumed = Checkpointer(tmp_path)  # a new process, later
    assert resumed.best_val == 1.0
    assert not resumed.save(state(model), 20, val_loss=2.0).best
    assert load(tmp_path / "best.pt")["step"] == 10


def test_best_is_a_checkpoint_taken_at_its_eval(tmp_path):
    """Evals every 30 steps (and at the last), checkpoints every 25: only the last
    checkpoint holds an eval's weights, so only it can be "best" (the one at step 50 had
    taken step 30's val loss for its own); and the last step's eval is its checkpoint's,
    written once."""
    import nbwatch
    from nbwatch.demo import make_demo

    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    vals = iter([3.0, 2.0, 1.0, 0.5])
    mon = nbwatch.Monitor(demo.model, demo.optimizer, run_dir=tmp_path / "r")
    mon.start(demo.step_fn, demo.train, max_steps=100, val_fn=lambda m: next(vals),
              eval_every=30, checkpoint_every=25, dry_run=False, display=False).wait()
    assert mon.state == "finished", mon.error
    ev = mon.events
    saved = ev[ev.kind == "checkpoint"]
    assert saved.step.tolist() == [25, 50, 75, 100]
    assert [bool(d.get("best")) for d in saved.data] == [False, False, False, True]
    best = load(tmp_path / "r" / "checkpoints" / "best.pt")
    assert best["step"] == 100 and best["val_loss"] == 0.5
    assert mon.df["loss/val"].dropna().index.tolist() == [30, 60, 90, 100]
