"""What nbwatch knows of the notebook it runs in: whether there is one, and the newest
Monitor (what a bare `%nbwatch` shows). A leaf module: it imports nothing of nbwatch."""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable
from typing import Any

_latest: weakref.ref[Any] | None = None
# the Monitors that started a run here, by the notebook cell that started it
_started: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def remember(monitor: Any) -> None:
    """Make `monitor` the one a bare `%nbwatch` shows (called by `Monitor.start`)."""
    global _latest
    _latest = weakref.ref(monitor)


def started_here(monitor: Any) -> None:
    """`monitor` started a run in this cell: remember it, and say so where a run this very
    cell started before still trains (the cell run again on a new model: the old run's
    dashboard is gone from the notebook and no variable names it, but it trains on)."""
    remember(monitor)
    cell = cell_id()
    if cell is None:
        return
    for other, where in list(_started.items()):
        if other is not monitor and where == cell and other._left_open():
            # its loop ran in this cell, which runs again: nothing trains it, and no
            # variable is left to end it with (`mon` names the new Monitor)
            step = other.step
            with contextlib.suppress(Exception):
                other.stop()
                other.close()
            print(f"nbwatch: the run this cell's loop left open at step {step} is stopped, "
                  f"with its checkpoint, in {other.run_dir} (a `with nbwatch.Monitor(...) as "
                  "mon:` around the loop closes it however the cell ends)", file=sys.stderr)
        elif other is not monitor and where == cell and other.running:
            print(f"nbwatch: the run this cell started before still trains ({other.state} at "
                  f"step {other.step}, in {other.run_dir}), beside this one. Stop it with "
                  f"nbwatch.attach({str(other.run_dir)!r}).stop()", file=sys.stderr)
    _started[monitor] = cell


def cell_id() -> str | None:
    """The id of the notebook cell running now (JupyterLab and Notebook 7 send it with each
    execution), None where none is sent or outside a kernel."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    kernel = getattr(get_ipython(), "kernel", None)
    try:
        cell = kernel.get_parent()["metadata"].get("cellId") if kernel is not None else None
    except (AttributeError, KeyError, TypeError):  # an older ipykernel, another front end
        return None
    return str(cell) if cell else None


def latest() -> Any | None:
    """The most recently started Monitor still alive, if any."""
    return _latest() if _latest is not None else None


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where a run shows its dashboard by default)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def current_cell() -> int | None:
    """The cell running now (IPython's execution count), None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    return None if ip is None else int(ip.execution_count)


def after_each_cell(fn: Callable[[], Any]) -> Callable[[], None] | None:
    """Call `fn()` after each cell the IPython shell runs (on the kernel's main thread);
    returns what unregisters it, or None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    if ip is None:
        return None

    def after(*_: Any) -> None:  # post_run_cell passes the cell's result
        fn()

    ip.events.register("post_run_cell", after)

    def unregister() -> None:
        with contextlib.suppress(ValueError):  # unregistered already
            ip.events.unregister("post_run_cell", after)
    return unregister


def enable_colab_widgets() -> bool:
    """In Colab, turn on its custom widget manager, which third-party widgets (the
    dashboard is an anywidget) need; elsewhere do nothing. True when it was turned on."""
    if "google.colab" not in sys.modules:  # Colab's kernel imports it at start
        return False
    try:
        from google.colab import output

        output.enable_custom_widget_manager()
    except Exception:  # an old or changed Colab: the dashboard says it waits for the kernel
        return False
    return True
