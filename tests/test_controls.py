import types

import pytest
import torch

import nbwatch
from nbwatch.controls import (
    CommandQueue,
    check_clip,
    check_factor,
    lrs,
    make_command,
    scale_lrs,
)


def make(kind, model=None):
    opt = torch.optim.SGD((model or torch.nn.Linear(2, 2)).parameters(), lr=0.1)
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
def test_scale_lr_survives_the_scheduler(kind, tmp_path):
    """Through the Monitor's optimizer hooks, as a loop of the user's own steps them."""
    ref_opt, ref_sched = make(kind)
    net = torch.nn.Linear(2, 2)
    opt, sched = make(kind, net)
    with nbwatch.Monitor(net, opt, sched, run_dir=tmp_path / kind,
                         display=False, hist_every=0) as mon:
        for i in range(15):
            for p in net.parameters():
                p.grad = torch.ones_like(p)
            ref_opt.step(), ref_sched.step()
            opt.step(), sched.step()
            mon.log(loss=0.0)
            if i == 4:
                mon.scale_lr(0.5)  # taken at the next log()
            if i >= 5:
                assert lrs(opt)[0] == pytest.approx(0.5 * lrs(ref_opt)[0], rel=1e-9), i


def test_plain_param_group_scaling_is_undone_by_a_scheduler():
    # Why the factor is taken off around the scheduler: the obvious route loses it.
    opt, sched = make("lambda")
    ref_opt, ref_sched = make("lambda")
    scale_lrs(opt, 0.5)
    opt.step(), sched.step(), ref_opt.step(), ref_sched.step()
    assert lrs(opt)[0] == pytest.approx(lrs(ref_opt)[0])


def test_queue_and_value_checks():
    q = CommandQueue()
    q.put(make_command("pause"))
    q.put(make_command("scale_lr", factor=0.5))
    assert [c.kind for c in q.drain()] == ["pause", "scale_lr"] and q.drain() == []
    with pytest.raises(ValueError, match="unknown command 'explode'"):
        make_command("explode")
    with pytest.raises(TypeError, match="rewind takes steps=, skip=; got step="):
        make_command("rewind", step=10)  # a misspelt argument names itself
    for bad in (10**9, -1, 2.5):
        with pytest.raises(ValueError, match="batches must be an int ≥ 1 and ≤ 100,000"):
            make_command("skip", batches=bad)
    assert make_command("rewind", steps=5, skip=0).payload == {"steps": 5, "skip": 0}
    assert check_clip(None) is None and check_clip(1) == 1.0
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            check_clip(bad)
        with pytest.raises(ValueError, match="positive finite"):
            check_factor(bad)


def test_chains_tells_closed_form_from_chainable_schedulers_and_restores_the_lr():
    import torch

    from nbwatch.controls import chains

    def sched(make):
        opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.5)
        return opt, make(opt)

    for make, expected in (
        (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9 ** s), False),
        (lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=10), False),
        (lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9), True),
        (lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5), True),
    ):
        opt, scheduler = sched(make)
        scheduler.step()
        before = [g["lr"] for g in opt.param_groups]
        assert chains(scheduler) is expected, type(scheduler).__name__
        assert [g["lr"] for g in opt.param_groups] == before
        assert "_nbwatch" not in str(scheduler.state_dict())


def test_one_command_table_makes_the_api_the_dispatch_and_the_buttons(tmp_path):
    """`controls.COMMANDS` is the one table: every kind of the enum is in it, its method on
    every handle takes the arguments its payload takes, the recorder dispatches each kind,
    and the page's buttons send exactly the table's arguments by name."""
    import inspect
    import re
    from pathlib import Path

    from nbwatch.adapters.fit_run import FitRun
    from nbwatch.attached import Attached
    from nbwatch.controls import COMMANDS, Controls, make_command, page_table
    from nbwatch.recorder.steering import DISPATCH
    from nbwatch.records import CommandKind
    from nbwatch.widget import Dashboard

    assert set(COMMANDS) == set(CommandKind) == set(DISPATCH)
    for kind, spec in COMMANDS.items():
        takes = list(inspect.signature(spec.args).parameters)
        for handle in (Controls, nbwatch.Monitor, Attached, FitRun):
            method = getattr(handle, spec.method)
            assert list(inspect.signature(method).parameters)[1:] == takes, (handle, kind)
    # the page builds its bar from the table it receives, and spells no command itself
    table = page_table()
    assert [c["kind"] for c in table] == [k.value for k, c in COMMANDS.items() if c.button]
    for c in table:
        takes = list(inspect.signature(COMMANDS[CommandKind(c["kind"])].args).parameters)
        assert [f["name"] for f in c["fields"]] == (takes if not c["instead_of"] else [])
        for f in c["fields"]:  # the page's starting value is one the command takes
            make_command(c["kind"], **{f["name"]: f["value"]})
    assert {c["instead_of"] for c in table} == {None, "pause"}
    page = (Path(__file__).parents[1] / "js" / "views" / "controls.js").read_text()
    assert not re.findall(r'kind: "\w+"', page), "the page spells a command of its own"
    for spec in COMMANDS.values():
        assert spec.button is None or f'"{spec.button}"' not in page, spec.button
    live = types.SimpleNamespace(run_dir=tmp_path, name="r", state="created", step=0,
                                 send=lambda kind, source="api", **args: "id")
    dashboard = Dashboard(tmp_path, monitor=live)  # what the widget sends the page
    try:
        assert dashboard.commands == table
    finally:
        dashboard.close()


@pytest.mark.parametrize("framework, fix", [
    ("hf", "resume_from_checkpoint="), ("lightning", "ckpt_path="), ("myfw", "checkpoint")])
def test_rewind_under_a_framework_names_its_own_resume(framework, fix):
    """A rewind under the Trainer pointed at nbwatch.checkpoint.load, which cannot read
    the Trainer's checkpoint-N folders: the refusal names the framework's own resume."""
    from nbwatch.controls import refuse_early
    with pytest.raises(RuntimeError) as e:
        refuse_early(make_command("rewind", steps=2), "running", True, framework)
    assert fix in str(e.value) and "nbwatch.checkpoint.load" not in str(e.value)
    with pytest.raises(RuntimeError, match="skip batches in its data loader"):
        refuse_early(make_command("skip", batches=1), "running", True, framework)
