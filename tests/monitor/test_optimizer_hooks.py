"""A Monitor's hooks on its optimizer as a part alone (`OptimizerWatch`), driven by a small
owner of its own: it hands each step to the owner's recorder, takes an optimizer from an
ended owner but never from a running one, refuses a second optimizer on the model while a
run is open, and notes the loop's own clips for the next step."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from nbwatch.monitor.optimizer_hooks import OptimizerWatch, clips_watched


class Recorder:
    hook_measures = True

    def __init__(self):
        self.pre, self.post = [], 0
        self.own = contextlib.nullcontext()

    def pre_step(self, explicit=False, clips=(), clip_note=None):
        self.pre.append([c.max_norm for c in clips])

    def post_step(self):
        self.post += 1


class Owner:
    """What OptimizerWatch asks of its run session, and nothing else."""

    def __init__(self, name="owner"):
        self.name, self.step, self.state, self.running = name, 0, "created", False
        self.rec: Recorder | None = None
        self.opened = 0

    def recorder_for_step(self, open_loop=True):
        if self.rec is None and open_loop:
            self.rec, self.running, self.opened = Recorder(), True, self.opened + 1
        return self.rec

    def clips_are_the_loops(self):
        return self.running


def model_and_optimizer():
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def one_step(model, opt, clip=None):
    model(torch.ones(3, 4)).square().sum().backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()


def test_each_step_goes_to_the_owners_recorder_and_a_loop_opens_at_its_first():
    model, opt = model_and_optimizer()
    owner = Owner()
    watch = OptimizerWatch(opt, model, owner)
    try:
        one_step(model, opt)
        one_step(model, opt)
        assert owner.opened == 1 and owner.rec.pre == [[], []] and owner.rec.post == 2
    finally:
        watch.remove()
    one_step(model, opt)  # hooks gone: nothing more handed over
    assert owner.rec.post == 2


def test_an_optimizer_is_taken_from_an_ended_owner_never_from_a_running_one():
    model, opt = model_and_optimizer()
    first = Owner("first")
    a = OptimizerWatch(opt, model, first)
    first.running = True
    with pytest.raises(RuntimeError, match="watched by a running Monitor \\('first'"):
        OptimizerWatch(opt, model, Owner("second"))
    first.running = False
    second = Owner("second")
    b = OptimizerWatch(opt, model, second)
    one_step(model, opt)
    assert first.rec is None and second.rec is not None and second.rec.post == 1
    b.remove()
    a.remove()


def test_a_second_optimizer_on_the_model_is_refused_while_a_run_is_open():
    model, opt = model_and_optimizer()
    watch = OptimizerWatch(opt, model, Owner())
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    watch.open_run()
    try:
        model(torch.ones(3, 4)).sum().backward()
        with pytest.raises(RuntimeError, match="a second optimizer \\(SGD\\) steps parameters"):
            other.step()
    finally:
        watch.close_run()
        watch.remove()
    other.step()  # the run closed: free


def test_the_loops_own_clip_is_noted_for_the_next_step_and_torch_is_given_back():
    model, opt = model_and_optimizer()
    owner = Owner()
    watch = OptimizerWatch(opt, model, owner)
    assert clips_watched()
    one_step(model, opt)  # opens the loop's run
    one_step(model, opt, clip=0.25)
    assert owner.rec.pre == [[], [0.25]]
    watch.close_run()
    watch.remove()
    gc.collect()  # Monitors of earlier tests in this process, made and dropped unused
    assert not clips_watched()
