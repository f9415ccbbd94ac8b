"""Commands at a run's end: a checkpoint asked while the last step is recorded is taken."""

from __future__ import annotations

import itertools
import time

import torch

import nbwatch
from nbwatch.demo import make_demo, masked_cross_entropy


def test_a_checkpoint_asked_as_the_last_step_is_recorded_is_taken(tmp_path):
    """`attach(run_dir).checkpoint()` from another handle lands in the store between the
    run's last `log()` and its end (the poll of the store runs every 0.25 s): it is applied,
    a checkpoint of the last step, not expired."""
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    m, opt = demo.model, demo.optimizer
    run_dir = tmp_path / "r"
    mon = nbwatch.Monitor(m, opt, run_dir=run_dir, display=False)

    def train():
        for b in itertools.islice(itertools.cycle(demo.train), 20):
            loss = masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
        other = nbwatch.attach(run_dir, display=False)
        other.checkpoint()  # the loop returns at once: the run ends
        other.close()

    mon.run(train).wait()
    assert mon.state == "finished", mon.error
    ev = mon.events
    outcome = ev[ev.data.map(lambda d: isinstance(d, dict) and d.get("command") == "checkpoint")]
    assert outcome.data.iloc[0]["outcome"] == "applied", outcome.message.tolist()
    saved = ev[ev.kind == "checkpoint"]
    assert saved.step.tolist() == [20], saved.message.tolist()  # one checkpoint of step 20


def _own_loop_run(tmp_path, steps, at_step=None, lr_of=None):
    """A small own-loop run: `at_step(mon, step)` after each log(); `lr_of(step)`, where
    given, is set into every param group before each step, as nanoGPT's loop does."""
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    m, opt = demo.model, torch.optim.SGD(demo.model.parameters(), lr=0.01)
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False)

    def train():
        for step, b in enumerate(itertools.islice(itertools.cycle(demo.train), steps), 1):
            if lr_of is not None:
                for g in opt.param_groups:
                    g["lr"] = lr_of(step)
            loss = masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
            if at_step is not None:
                at_step(mon, step)

    mon.run(train).wait()
    assert mon.state == "finished", mon.error
    return mon


def test_commands_written_into_the_store_by_hand_are_checked_where_they_are_applied(tmp_path):
    """Rows another process writes into a live run's `commands` table never went through
    `make_command`: a negative or NaN LR factor, a negative clip and a skip past the cap
    are refused where the run applies them, each with an outcome naming the argument."""
    from nbwatch.records import Command, CommandKind
    from nbwatch.store.schema import send_command

    bad = [Command(CommandKind.SCALE_LR, {"factor": -1}),
           Command(CommandKind.SCALE_LR, {"factor": "nan"}),
           Command(CommandKind.CLIP, {"max_norm": -5}),
           Command(CommandKind.SKIP, {"batches": 10**12}),
           Command(CommandKind.REWIND, {"steps": "x"})]

    def at_step(mon, step):
        if step == 3:
            for c in bad:
                send_command(mon.run_dir, c)
            time.sleep(0.4)  # the run polls the store every 0.25 s

    mon = _own_loop_run(tmp_path, 8, at_step)
    ev = mon.events
    for c in bad:
        out = ev[ev.data.map(lambda d, c=c: isinstance(d, dict) and d.get("id") == c.id)]
        assert out.data.tolist() and out.data.iloc[0]["outcome"] == "refused", (c, out)
        reason = out.data.iloc[0]["reason"]
        assert str(next(iter(c.payload.values()))) in reason, reason
    df = mon.df
    assert (df["lr"].dropna() == 0.01).all(), df["lr"].tolist()
    assert "grad_norm/clipped" not in df or df["grad_norm/clipped"].dropna().ge(0).all()
    assert len(df["loss/train"].dropna()) == 8


def test_a_cut_lr_holds_in_a_loop_that_sets_the_lr_itself(tmp_path):
    """nanoGPT's loop sets `g["lr"] = get_lr(it)` before every step, with no scheduler: a
    Cut LR ×0.5 (queued after step 4's log(), applied at the next boundary, step 5's) holds
    on the loop's schedule from step 6 on (the LR recorded is the one the optimizer used),
    rather than being said and then overwritten."""
    def lr_of(step):
        return 0.01 * (1 + step / 10)

    def at_step(mon, step):
        if step == 4:
            mon.scale_lr(0.5)

    mon = _own_loop_run(tmp_path, 10, at_step, lr_of)
    lr = mon.df["lr"].dropna()
    for step in range(1, 11):
        want = lr_of(step) * (0.5 if step > 5 else 1.0)
        assert abs(lr.loc[step] - want) < 1e-12, (step, lr.loc[step], want)


def test_a_cut_lr_holds_once_under_a_scheduler_the_monitor_was_not_given(tmp_path):
    """A loop that steps a scheduler of its own (not passed to the Monitor: it scales the
    current LR, as CosineAnnealingLR does) and is cut ×0.5: the LR used is 0.5 × the plain
    schedule at every later step, never compounded step after step."""
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    m, opt = demo.model, torch.optim.SGD(demo.model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    plain_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    plain = torch.optim.lr_scheduler.CosineAnnealingLR(plain_opt, T_max=50)
    want = {}
    for step in range(1, 13):
        want[step] = plain_opt.param_groups[0]["lr"]
        plain_opt.step()
        plain.step()
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False)

    def train():
        for step, b in enumerate(itertools.islice(itertools.cycle(demo.train), 12), 1):
            loss = masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            mon.log(loss=loss)
            if step == 4:
                mon.scale_lr(0.5)

    mon.run(train).wait()
    lr = mon.df["lr"].dropna()
    for step in range(1, 13):
        factor = 0.5 if step > 5 else 1.0
        assert abs(lr.loc[step] - factor * want[step]) < 1e-9, (step, lr.loc[step], want[step])


def test_a_rewind_row_with_a_malformed_decided_target_is_refused_not_fatal(tmp_path):
    """A row that carries what only the recorder decides (`to`, the checkpoint's step) is
    checked too: a `to` that is not a step is refused, and the run goes on."""
    from nbwatch.records import Command, CommandKind
    from nbwatch.store.schema import send_command

    bad = Command(CommandKind.REWIND, {"steps": 1, "skip": 0, "to": "x"})

    def at_step(mon, step):
        if step == 3:
            send_command(mon.run_dir, bad)
            time.sleep(0.4)

    mon = _own_loop_run(tmp_path, 8, at_step)
    ev = mon.events
    out = ev[ev.data.map(lambda d: isinstance(d, dict) and d.get("id") == bad.id)]
    assert out.data.iloc[0]["outcome"] == "refused" and "to must be" in out.data.iloc[0]["reason"]


def test_a_cut_lr_still_holds_after_a_resume_in_a_loop_that_sets_the_lr(tmp_path):
    """A loop that writes the same LR every step, cut ×0.5, stopped and resumed: the resumed
    run keeps using half the loop's LR (the checkpoint carries the factor and whether it is
    on the optimizer's LRs)."""
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    m, opt = demo.model, torch.optim.SGD(demo.model.parameters(), lr=0.1)

    def loop(mon, steps, cut_at=None):
        for step, b in enumerate(itertools.islice(itertools.cycle(demo.train), steps), 1):
            for g in opt.param_groups:
                g["lr"] = 0.1
            loss = masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
            if step == cut_at:
                mon.scale_lr(0.5)

    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False)
    mon.run(loop, mon, 6, 2).wait()
    mon2 = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False, resume=True)
    mon2.run(loop, mon2, 4).wait()
    lr = nbwatch.open_run(tmp_path / "r").df["lr"]
    assert lr.loc[1:3].tolist() == [0.1, 0.1, 0.1]
    assert lr.loc[4:10].tolist() == [0.05] * 7, lr.tolist()


def test_cut_lr_says_every_param_groups_lr(tmp_path):
    """Three groups (no decay on biases, a head at 10× the LR): the event names each LR
    moved, not group 0's alone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD([{"params": [model[0].weight], "lr": 0.01},
                           {"params": [model[0].bias], "lr": 0.01, "weight_decay": 0.0},
                           {"params": model[1].parameters(), "lr": 0.1}], lr=0.01)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    for step in range(1, 5):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 2:
            mon.scale_lr(0.5)
        mon.log(loss=torch.tensor(1.0))
    mon.close()
    said = mon.events[mon.events.message.str.startswith("LR scaled")].message.tolist()
    assert said == ["LR scaled ×0.5 (factor now 0.5): 3 param groups: 0.01 → 0.005, "
                    "0.1 → 0.05"], said
    assert mon.df.loc[3:, ["lr", "lr/group2"]].values.tolist() == [[0.005, 0.05]] * 2
