"""nbwatch: watch and steer a PyTorch training run live from inside a notebook.

>>> %load_ext nbwatch
>>> mon = nbwatch.Monitor(model, optimizer, scheduler, run_dir="runs/exp1")
>>> mon.start(step_fn, loader, max_steps=2000, val_fn=val_fn, eval_every=200)
"""

from __future__ import annotations

__version__ = "0.1.0"

from .attach import attach
from .compare import compare
from .distributed import launch
from .export import export_html
from .monitor import Monitor
from .probes.loss import masked_cross_entropy
from .recorder import StopTraining
from .run import Run, open_run
from .tensorboard import to_tensorboard

__all__ = ["Monitor", "Run", "open_run", "attach", "compare", "export_html", "to_tensorboard",
           "launch",
           "masked_cross_entropy", "StopTraining", "load_ipython_extension"]


def load_ipython_extension(ipython):  # noqa: ANN001 - IPython's own type, imported lazily
    """`%load_ext nbwatch`: registers the `%nbwatch` magic."""
    from .magic import register

    register(ipython)
