"""What nbwatch knows of the notebook it runs in: whether there is one, and the newest
Monitor (what a bare `%nbwatch` shows). A leaf module: it imports nothing of nbwatch."""

from __future__ import annotations

import sys
import weakref
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
