"""A Monitor's hooks on its optimizer as a part alone (`OptimizerWatch`), driven by a small
owner of its own: it hands each step to the owner's recorder, takes an optimizer from an
ended owner but never from a running one, refuses a second optimizer on the model while a
run is open, and notes the loop's own clips for the next step."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from nbwatch.monitor.clip_watch import clips_watched
from nbwatch.monitor.optimizer_hooks import OptimizerWatch


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
        self.mode = self.framework = self.loop_thread = None  # no loop of one's own

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
        with pytest.raises(RuntimeError, match=r"a second optimizer \(SGD, over "
                           r".* re-created mid-run"):  # all its weights: a replacement
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


@pytest.mark.parametrize("gpu_order", [False, True])
def test_a_closure_optimizers_step_is_measured_after_its_closure_made_the_gradients(
        tmp_path, monkeypatch, gpu_order):
    """LBFGS makes a step's gradients inside `step(closure)`, after the pre-hook: the
    figures are those of the closure's first call (the gradients at the weights the step
    starts from, as the loop computes them), from the first step; the update ratios are
    taken; a non-finite step is skipped with the weights untouched. They used to be the
    previous step's last closure's gradients, and none at step 1."""
    import nbwatch
    from nbwatch.recorder import host_copy

    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    mine, untouched = [], []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False, hist_every=2,
                         alerts={"nonfinite": {"actions": ["skip_step"]}}) as mon:
        for step in range(6):
            first: list[float] = []

            def closure(step=step, first=first):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                if step == 3:
                    loss = loss * float("nan")
                loss.backward()
                if not first:
                    first.append(float(torch.nn.utils.get_total_norm(
                        [p.grad for p in model.parameters()])))
                return loss

            before = [p.detach().clone() for p in model.parameters()]
            loss = opt.step(closure)
            untouched.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
            mine.append(first[0])
            mon.log(loss=loss)
    df = nbwatch.open_run(tmp_path / "r").df
    kept = [i for i in range(6) if i != 3]
    assert df["grad_norm/global"].iloc[kept].tolist() == pytest.approx(
        [mine[i] for i in kept], rel=1e-5)
    assert df["update_ratio/0"].notna().loc[[1, 2, 6]].all()  # 4 was skipped
    assert df.loc[4, "skipped"] == 1.0 and untouched == [False, False, False, True, False, False]


class Sam(torch.optim.Optimizer):
    """SAM as its common implementation writes it: a wrapper over a base optimizer that
    shares its param groups, stepped by the loop in two halves."""

    def __init__(self, params, rho: float = 0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = torch.optim.SGD(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["e"] = e = p.grad * g["rho"]
                p.add_(e)

    @torch.no_grad()
    def second_step(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                p.sub_(self.state[p]["e"])
        self.base_optimizer.step()

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.first_step()
        self.zero_grad()
        with torch.enable_grad():
            closure()
        self.second_step()


def test_a_wrapper_stepped_in_halves_names_the_optimizer_to_pass(tmp_path):
    """SAM's `first_step`/`second_step` step its `base_optimizer`, never its own `step()`:
    `log()` said only "before any optimizer step" to a loop that had stepped. It names the
    optimizer to pass now; given that one, the norms are those of the second pass."""
    import nbwatch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)

    def two_passes(opt: Sam) -> float:
        model(x).pow(2).mean().backward()
        opt.first_step()
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        opt.second_step()
        opt.zero_grad()
        return norm

    opt = Sam(model.parameters(), lr=0.1)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "a", display=False)
    two_passes(opt)
    with pytest.raises(RuntimeError, match=r"Sam.step\(\) never ran: .*\.base_optimizer "
                       r"\(SGD\).*Monitor\(model, optimizer\.base_optimizer"):
        mon.log(loss=0.0)
    opt = Sam(model.parameters(), lr=0.1)
    mine = []
    with nbwatch.Monitor(model, opt.base_optimizer, run_dir=tmp_path / "b",
                         display=False) as mon:
        for _ in range(3):
            mine.append(two_passes(opt))
            mon.log(loss=0.0)
    assert nbwatch.open_run(tmp_path / "b").df["grad_norm/global"].tolist() == \
        pytest.approx(mine, rel=1e-5)


@pytest.mark.parametrize("gpu_order", [False, True])
def test_a_closure_step_that_moves_the_weights_first_has_its_update_ratio_from_its_start(
        tmp_path, monkeypatch, gpu_order):
    """SAM's `step(closure)` moves the weights (its ascent step) before it calls the
    closure: the update ratio is ‖W_after − W_before‖ / ‖W_before‖ of the weights the step
    started from. It was taken from the moved weights (off by up to 36% here, 5× on
    a two-layer MLP)."""
    import nbwatch
    from nbwatch.recorder import host_copy

    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)
    opt = Sam(model.parameters(), rho=0.5, lr=0.1)
    mine = []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False,
                         update_every=1) as mon:
        for _ in range(3):
            model(x).pow(2).mean().backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step(lambda: model(x).pow(2).mean().backward())
            opt.zero_grad()
            delta = torch.stack([(p.detach() - b).norm() for p, b in
                                 zip(model.parameters(), before)]).norm()
            mine.append(float(delta / torch.stack([b.norm() for b in before]).norm()))
            mon.log(loss=0.0)
    df = nbwatch.open_run(tmp_path / "r").df
    assert df["update_ratio/(root)"].tolist() == pytest.approx(mine, rel=1e-4)
