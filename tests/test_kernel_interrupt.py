"""The kernel's interrupt button (SIGINT to the kernel) while a run trains in its thread:
it ends a cell's `mon.wait()`, not the run, and the traceback the cell shows says so. A real
kernel through jupyter_client, interrupted the way JupyterLab does it."""

from __future__ import annotations

import _thread
import re
import threading
import time

import pytest

import nbwatch
from tests.conftest import until
from tests.test_kernel_shutdown import training_in_kernel

pytest.importorskip("jupyter_client")


@pytest.mark.slow
def test_interrupt_in_wait_ends_the_wait_not_the_run_and_says_so(tmp_path):
    """The cell showed a bare KeyboardInterrupt inside threading.py, and the run trained on
    unseen by whoever pressed Interrupt to stop it."""
    run_dir = tmp_path / "int"
    k = training_in_kernel(tmp_path, run_dir, eval_every=10_000, steps=3)
    try:
        msg_id = k.kc.execute("mon.wait()")
        time.sleep(1.5)  # the cell waits
        k.km.interrupt_kernel()
        reply = k.kc.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id
        content = reply["content"]
        assert content["status"] == "error" and content["ename"] == "KeyboardInterrupt"
        shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(content["traceback"]))
        assert "Ctrl-C ended the wait, not the run: it is running at step" in shown, shown
        assert str(run_dir) in shown
        step = nbwatch.open_run(run_dir).step
        until(lambda: nbwatch.open_run(run_dir).step > step + 2, 60, "the run to train on")
        k.run("assert mon.running and mon.state == 'running', mon.state")
    finally:
        k.shut_down()


def test_interrupt_in_an_attached_wait_says_the_run_trains_on(tmp_path):
    """`nbwatch.attach(DIR).wait()` (another process's run, or this one's) says the same."""
    from nbwatch.demo import make_demo

    demo = make_demo(d=16, layers=1, heads=1, ctx=16, max_steps=100_000)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "a")
    mon.start(max_steps=100_000, eval_every=10_000, display=False, **demo.start_kwargs())
    try:
        until(lambda: mon.step >= 2, 60, "two steps")
        threading.Timer(0.5, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt) as got:
            nbwatch.attach(mon.run_dir).wait()
        assert "Ctrl-C ended the wait, not the run" in " ".join(got.value.__notes__)
        assert mon.running
    finally:
        mon.stop()
        mon.wait()


def test_on_python_3_10_the_interrupt_itself_says_the_run_trains_on(monkeypatch):
    """Python 3.10 (supported) has no `add_note`: the wait's Ctrl-C raised an AttributeError
    from inside its handler instead of the KeyboardInterrupt; its message says it there."""
    from types import SimpleNamespace

    from nbwatch import interrupts

    monkeypatch.setattr(interrupts, "_NOTES", False, raising=False)
    run = SimpleNamespace(running=True, state="running", step=3, run_dir="runs/x")
    with pytest.raises(KeyboardInterrupt) as got, interrupts.wait_only(run):
        raise KeyboardInterrupt
    assert "Ctrl-C ended the wait, not the run: it is running at step 3 in runs/x" in str(
        got.value)  # (not only in a note, which 3.10 neither has nor shows)
