import pytest
import torch

from nbwatch.controls import CommandQueue, check_clip, check_factor, lrs, scale_lrs, scheduler_step
from nbwatch.records import Command


def make(kind):
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    if kind == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    elif kind == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    elif kind == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=100)
    elif kind == "exponential":  # chainable: reads the current group LR
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    else:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return opt, sched


@pytest.mark.parametrize("kind", ["lambda", "cosine", "onecycle", "exponential", "step"])
def test_scale_lr_survives_the_scheduler(kind):
    ref_opt, ref_sched = make(kind)
    opt, sched = make(kind)
    for _ in range(5):
        ref_opt.step(), ref_sched.step()
        opt.step(), scheduler_step(sched, opt, 1.0)
    factor = 0.5
    scale_lrs(opt, factor)  # what the runner does when scale_lr(0.5) arrives
    assert lrs(opt)[0] == pytest.approx(factor * lrs(ref_opt)[0])
    for _ in range(10):
        ref_opt.step(), ref_sched.step()
        opt.step(), scheduler_step(sched, opt, factor)
        assert lrs(opt)[0] == pytest.approx(factor * lrs(ref_opt)[0], rel=1e-9)


def test_plain_param_group_scaling_is_undone_by_a_scheduler():
    # Why scheduler_step exists: the obvious route loses the factor one step later.
    opt, sched = make("lambda")
    ref_opt, ref_sched = make("lambda")
    scale_lrs(opt, 0.5)
    opt.step(), sched.step(), ref_opt.step(), ref_sched.step()
    assert lrs(opt)[0] == pytest.approx(lrs(ref_opt)[0])


def test_queue_and_value_checks():
    q = CommandQueue()
    q.put(Command("pause"))
    q.put(Command("scale_lr", 0.5))
    assert [c.kind for c in q.drain()] == ["pause", "scale_lr"] and q.drain() == []
    with pytest.raises(ValueError, match="unknown command 'explode'"):
        q.put(Command("explode"))
    assert check_clip(None) is None and check_clip(1) == 1.0
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            check_clip(bad)
        with pytest.raises(ValueError, match="positive finite"):
            check_factor(bad)
