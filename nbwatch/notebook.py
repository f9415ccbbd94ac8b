"""What nbwatch knows of the notebook it runs in: whether there is one, and the newest
Monitor (what a bare `%nbwatch` shows). A leaf module: it imports nothing of nbwatch."""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable
from typing import Any

_latest: weakref.ref[Any] | None = None


def remember(monitor: Any) -> None:
    """Make `monitor` the one a bare `%nbwatch` shows (called by `Monitor.start`)."""
    global _latest
    _latest = weakref.ref(monitor)


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
