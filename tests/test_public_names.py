"""The public names of `nbwatch` and of a `Monitor`: users' code is written against them,
so a new one (or one gone) is a decision made here, not a side effect."""

from __future__ import annotations

import torch

import nbwatch

PACKAGE = ["Monitor", "Run", "StopTraining", "attach", "compare", "export_html", "launch",
           "load_ipython_extension", "masked_cross_entropy", "open_run", "to_tensorboard"]

# methods and properties of the class
MONITOR = ["branches", "checkpoint", "close", "closed", "df", "diagnose", "error", "events",
           "export_html", "log", "open_external", "pause", "preflight", "resume", "rewind",
           "run", "running", "scale_lr", "send", "set_clip", "show", "skip", "spikes",
           "start", "state", "step", "stop", "stopping", "submit", "system", "traceback",
           "wait", "wait_closed"]

# what a Monitor holds (the guide documents model, optimizer, run_dir, name, config,
# rewound, skip_batches; checkpointer, control, rules, scheduler and scaler serve the
# adapters, the widget and tests; the rest of its state is private)
MONITOR_DATA = ["checkpointer", "config", "control", "model", "name", "optimizer",
                "rewound", "rules", "run_dir", "scaler", "scheduler", "skip_batches"]


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
