"""A notebook cell that starts a run, run again while that run trains (on a new model, as
Run All does): the old run's dashboard leaves the notebook and `mon` names the new Monitor,
but the old run trains on. The cell says so. A real kernel through jupyter_client, each
execution sent with the cell id JupyterLab sends."""

from __future__ import annotations

import textwrap

import pytest

import nbwatch
from tests.conftest import until
from tests.test_kernel_shutdown import Kernel, in_kernel

pytest.importorskip("jupyter_client")

START = """
    demo = make_demo(d=16, layers=1, heads=1, ctx=16, max_steps=100_000)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler)
    mon.start(max_steps=100_000, eval_every=10_000, display=False, **demo.start_kwargs())
"""


def in_cell(k: Kernel, cell: str, code: str) -> str:
    """Run `code` as the notebook cell `cell`; what it wrote to stderr."""
    msg = k.kc.session.msg("execute_request", {
        "code": textwrap.dedent(code), "silent": False, "store_history": True,
        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
        metadata={"cellId": cell})
    k.kc.shell_channel.send(msg)
    err: list[str] = []
    while True:
        out = k.kc.get_iopub_msg(timeout=60)
        if out["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            continue
        if out["msg_type"] == "stream" and out["content"]["name"] == "stderr":
            err.append(out["content"]["text"])
        if out["msg_type"] == "status" and out["content"]["execution_state"] == "idle":
            break
    reply = k.kc.get_shell_msg(timeout=60)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(err)


@pytest.mark.slow
def test_a_start_cell_run_again_says_its_earlier_run_still_trains(tmp_path):
    k = in_kernel(tmp_path, "import nbwatch\nfrom nbwatch.demo import make_demo")
    try:
        assert "nbwatch" not in in_cell(k, "c1", START)
        first = next((tmp_path / "runs").iterdir())
        until(lambda: (first / "nbwatch.db").exists() and nbwatch.open_run(first).step >= 2,
              60, "the first run to take 2 steps")
        k.run("import time; time.sleep(1.1)")  # a new default run_dir (one a second)
        said = in_cell(k, "c2", "mon2 = mon\n" + textwrap.dedent(START))  # another cell: silent
        assert "nbwatch" not in said, said
        k.run("time.sleep(1.1)")
        said = in_cell(k, "c1", START)  # the first cell again, while its run trains
        assert "the run this cell started before still trains" in said, said
        assert f"nbwatch.attach({str(first.absolute())!r}).stop()" in said
        assert said.count("nbwatch:") == 1, said  # the other cell's run is not this cell's
    finally:
        k.shut_down()


OWN_LOOP = """
    import torch
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nbwatch.Monitor(model, opt, display=False)
    for _ in range(3):                       # no `with`: the run stays open after the cell
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        mon.log(loss=loss)
"""


@pytest.mark.slow
def test_a_cell_whose_own_loop_left_its_run_open_run_again_stops_that_run(tmp_path):
    """A loop of one's own in a cell, without `with`, leaves its run open when the cell
    ends (or raises mid-loop); nothing trains it. The cell run again on a new model stops
    it (its stop checkpoint written, the folder closed) and says so: the old run's only
    name, `mon`, now names the new Monitor."""
    k = in_kernel(tmp_path, "import nbwatch")
    try:
        assert "nbwatch" not in in_cell(k, "c1", OWN_LOOP)
        first = next((tmp_path / "runs").iterdir())
        k.run("import time; time.sleep(1.1)")  # a new default run_dir (one a second)
        said = in_cell(k, "c1", OWN_LOOP)
        assert "the run this cell's loop left open at step 3 is stopped" in said, said
        assert "still trains" not in said, said
        run = nbwatch.open_run(first)
        assert run.state == "stopped" and run.step == 3
        assert (run.events["kind"] == "checkpoint").any()
        second = [p for p in (tmp_path / "runs").iterdir() if p != first]
        assert len(second) == 1  # the new run trains on, its own (it is left open too)
        until(lambda: nbwatch.open_run(second[0]).step == 3, 30, "the new run's 3 steps")
    finally:
        k.shut_down()
