"""nbwatch: watch and steer a PyTorch training run live from inside a notebook.

>>> %load_ext nbwatch
>>> mon = nbwatch.Monitor(model, optimizer, scheduler, run_dir="runs/exp1")
>>> mon.start(step_fn, loader, max_steps=2000, val_fn=val_fn, eval_every=200)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

# Public name -> the module that defines it. Imported on first use (PEP 562), so that
# `import nbwatch` and `nbwatch --help` do not pay for torch; `nbwatch.Monitor` etc. work
# exactly as before.
_LAZY = {
    "Monitor": ".monitor",
    "Run": ".run",
    "open_run": ".run",
    "attach": ".attached",
    "compare": ".comparison",
    "launch": ".torchrun",
    "export_html": ".export",
    "to_tensorboard": ".tensorboard",
    "masked_cross_entropy": ".probes.loss",
    "StopTraining": ".recorder",
}

__all__ = ["Monitor", "Run", "open_run", "attach", "compare", "export_html", "to_tensorboard",
           "launch",
           "masked_cross_entropy", "StopTraining", "load_ipython_extension"]

if TYPE_CHECKING:  # for type checkers and IDEs: the names as if imported eagerly
    from .attached import attach
    from .comparison import compare
    from .export import export_html
    from .monitor import Monitor
    from .probes.loss import masked_cross_entropy
    from .recorder import StopTraining
    from .run import Run, open_run
    from .tensorboard import to_tensorboard
    from .torchrun import launch


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    try:  # `import nbwatch; nbwatch.store.RunReader`, as when everything was imported eagerly
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython):  # noqa: ANN001 - IPython's own type, imported lazily
    """`%load_ext nbwatch`: registers the `%nbwatch` magic."""
    from .magic import register

    register(ipython)
