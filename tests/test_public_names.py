"""The public names of `nbwatch` and of a `Monitor`: users' code is written against them,
so a new one (or one gone) is a decision made here, not a side effect."""

from __future__ import annotations

import torch

import nbwatch

PACKAGE = ["Monitor", "Run", "StopTraining", "attach", "compare", "export_html", "launch",
           "load_ipython_extension", "masked_cross_entropy", "open_run", "to_tensorboard"]

# methods and properties of the class
MONITOR = ["branches", "checkpoint", "checkpointer", "close", "closed", "config", "control",
           "df", "diagnose", "error", "events", "export_html", "log", "model", "name",
           "open_external", "optimizer", "pause", "preflight", "resume", "rewind", "rules",
           "run", "run_dir", "running", "scale_lr", "scaler", "scheduler", "send", "set_clip",
           "show", "skip", "spikes", "start", "state", "step", "stop", "stopping", "submit",
           "system", "traceback", "wait", "wait_closed"]

# what it was given is read-only (properties over its setup: model, optimizer, scheduler,
# scaler, run_dir, name, config, checkpointer, control, rules); the data a loop of one's
# own reads after log() is all that a Monitor holds in the open; its parts are private
MONITOR_DATA = ["rewound", "skip_batches"]
GIVEN = ["checkpointer", "config", "control", "model", "name", "optimizer", "rules", "run_dir",
         "scaler", "scheduler"]


def test_the_package_exports_what_it_documents():
    assert sorted(nbwatch.__all__) == PACKAGE
    for name in PACKAGE:
        assert getattr(nbwatch, name) is not None, name


def test_a_monitors_public_names_are_a_decision(tmp_path):
    assert sorted(n for n in dir(nbwatch.Monitor) if not n.startswith("_")) == MONITOR
    model = torch.nn.Linear(2, 2)
    mon = nbwatch.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          run_dir=tmp_path / "r", display=False)
    assert sorted(n for n in vars(mon) if not n.startswith("_")) == MONITOR_DATA
    for name in GIVEN:  # read-only: a run's objects are not swapped under it
        try:
            setattr(mon, name, None)
        except AttributeError:
            continue
        raise AssertionError(f"mon.{name} can be replaced")
