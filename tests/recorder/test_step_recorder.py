"""A run that fails: its emergency checkpoint holds trained weights, or none is written."""

from __future__ import annotations

import itertools

import pytest
import torch

import nbwatch
from nbwatch.demo import make_demo


def failing_at(demo, call: int):
    calls = itertools.count(1)

    def step_fn(model, batch):
        if next(calls) == call:
            raise RuntimeError("a collate bug")
        return demo.step_fn(model, batch)
    return step_fn


@pytest.mark.parametrize("fail_at, saved", [(1, False), (4, True)])
def test_a_failure_before_the_first_step_writes_no_checkpoint(tmp_path, fail_at, saved):
    """Failing at step 1 (before any optimizer step): no `step_00000000.pt` of untrained
    weights, and an event says why; failing later: the emergency checkpoint as before."""
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, run_dir=tmp_path / "r", display=False)
    mon.start(failing_at(demo, fail_at), itertools.cycle(demo.train), max_steps=20,
              display=False, dry_run=False)
    with pytest.raises(RuntimeError, match="a collate bug"):
        mon.wait()
    assert mon.state == "failed"
    files = sorted(p.name for p in (tmp_path / "r" / "checkpoints").glob("*.pt"))
    assert files == ([f"step_{fail_at - 1:08d}.pt"] if saved else [])
    said = mon.events.message.str.startswith("no emergency checkpoint")
    assert said.any() != saved


def test_a_trainer_failing_at_step_0_writes_no_checkpoint_0(tmp_path):
    pytest.importorskip("transformers")
    import nbwatch.hf
    from tests.test_hf import make_trainer

    trainer = make_trainer(tmp_path / "out")

    def compute_loss(*a, **k):
        raise KeyError("labels: removed by remove_unused_columns")

    trainer.compute_loss = compute_loss
    run = nbwatch.hf.start(trainer, run_dir=tmp_path / "run", display=False)
    with pytest.raises(KeyError):
        run.wait()
    assert run.state == "failed"
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    assert run.events.message.str.startswith("no emergency checkpoint").any()


def test_a_second_ctrl_c_between_the_end_state_and_its_record_still_records_it(tmp_path):
    """Ctrl-C ends a loop of one's own as a stop; a second press that lands after the run
    moved to `stopped` but before the folder says so must not leave it reading `running`
    (then `stale`): the abandoned end records the state all the same."""
    import nbwatch
    from nbwatch import Run

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False, hist_every=0,
                          attention_samples=0)
    for _ in range(3):
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        mon.log(loss=1.0)
    store = mon._session.recorder.store
    real, pressed = store.set_meta, []

    def set_meta(key, value):
        if key == "state" and value == "stopped" and not pressed:
            pressed.append(1)
            raise KeyboardInterrupt  # the second press, as the end state is written
        return real(key, value)

    store.set_meta = set_meta
    with pytest.raises(KeyboardInterrupt):
        mon.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert pressed and mon.state == "stopped"
    assert Run(tmp_path / "r").meta["state"] == "stopped"
