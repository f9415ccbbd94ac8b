"""`nbwatch.launch` of a job that never opens its run: refused at the call where it cannot
start, failed (exit code, the end of its output) where its process dies first."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import nbwatch
from nbwatch.store import RunInUse
from nbwatch.store.liveness import RunFailed
from tests.conftest import until

CRASH = """\
import sys
print("loading the data", flush=True)
if __name__ == "__main__":
    raise RuntimeError("no data at /nowhere/train.bin")
"""


def script(tmp_path: Path, text: str = CRASH) -> Path:
    path = tmp_path / "train.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize("nproc", [0, -1, 1.5])
def test_launch_refuses_fewer_than_one_process(tmp_path, nproc):
    with pytest.raises(ValueError, match=r"nproc must be an int ≥ 1.*got"):
        nbwatch.launch(script(tmp_path), nproc=nproc, run_dir=tmp_path / "r", display=False)
    assert not (tmp_path / "r" / "torchrun.log").exists()  # nothing was started


def test_a_job_that_crashes_before_its_run_opens_fails_with_its_exit_code_and_output(
        tmp_path):
    job = nbwatch.launch(script(tmp_path), nproc=1, run_dir=tmp_path / "r", display=False)
    with pytest.raises(RunFailed, match="exited with code 1 before its run opened") as got:
        job.wait(timeout=120)
    assert "RuntimeError: no data at /nowhere/train.bin" in str(got.value)
    assert job.state == "failed" and job.process.returncode == 1
    assert "no data at /nowhere/train.bin" in job.message


def test_launch_into_a_folder_a_live_run_holds_is_refused(tmp_path):
    """A live run's folder: refused before any process starts (the handle would read that
    other run's state as the job's)."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    go = threading.Event()

    def step(m, x):
        go.wait(30)
        return m(x).square().mean()

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    mon.start(step, [torch.ones(1, 2)] * 4, max_steps=4)
    try:
        until(lambda: mon.state == "running", what="the run holds its folder")
        with pytest.raises(RunInUse, match="being written by a run of this very process"):
            nbwatch.launch(script(tmp_path), nproc=1, run_dir=tmp_path / "r", display=False)
        assert not (tmp_path / "r" / "torchrun.log").exists()
    finally:
        go.set()
        mon.wait()


def test_a_job_that_opens_no_run_fails_rather_than_reading_the_folders_old_run(tmp_path):
    """A finished run already in the folder is not the job's: its handle does not report
    that run's state or step, and a job that exits without opening its own fails."""
    model = torch.nn.Linear(2, 1)
    old = nbwatch.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          run_dir=tmp_path / "r", display=False)
    old.start(lambda m, x: m(x).square().mean(), [torch.ones(1, 2)] * 2, max_steps=2).wait()
    job = nbwatch.launch(script(tmp_path, "print('forgot the Monitor')\n"), nproc=1,
                         run_dir=tmp_path / "r", display=False)
    assert (job.state, job.step) in {("waiting", 0), ("failed", 0)}
    with pytest.raises(RunFailed, match=r"exited \(code 0\) without opening a run"):
        job.wait(timeout=120)
    assert (job.state, job.step) == ("failed", 0)
