"""A command's one outcome: however many ends of a run find it, it is said once."""

import torch
from torch import nn

import nbwatch
from nbwatch.recorder.outcomes import Expired
from nbwatch.recorder.steering import record_outcome
from nbwatch.records import Command


def test_a_command_found_by_two_ends_of_the_run_has_one_outcome(tmp_path):
    """A failure's end and the close's both expire what is left (under torchrun a stop
    rank 0 took for a meeting that a dead rank never joined was found by both): one
    'expired' event for its id, as `run.events` promises (the suite saw two)."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    mon.log(loss=1.0)
    rec = mon._session.recorder
    cmd = Command("stop", source="api")
    for _ in range(2):
        record_outcome(rec, cmd, Expired("the run ended at step 1 before taking it"))
    mon.close()
    ev = nbwatch.open_run(tmp_path / "r").events
    said = ev[ev["data"].map(lambda d: isinstance(d, dict) and d.get("id") == cmd.id)]
    assert said["message"].tolist() == ["stop expired: the run ended at step 1 before taking it"]
