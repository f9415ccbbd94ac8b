"""The dashboard: one anywidget that tails a run's store and draws every panel.

The widget holds no training logic. A daemon thread polls the store at ≤ 4 Hz (id cursors:
each poll costs what arrived since the last) and sends one custom message per refresh
with only what is new, numeric series as binary buffers. A view that renders late (page
reload, a second view) says "hello" and gets the whole downsampled state back. Buttons
send one command message; it calls the Monitor's control method, and the runner's event
coming back through the store is what the page shows as the acknowledgement.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from .controls import page_table
from .lifecycle import STALE, is_ended
from .notebook import enable_colab_widgets, remember
from .panels import Feed, attention
from .panels.baseline import beside
from .panels.wire import pack
from .store import RunReader, is_run_dir

log = logging.getLogger("nbwatch.widget")
TICK_S = 5.0  # the longest the page hears nothing while the poll runs (js/index.js: 15 s)
# What a live dashboard watches: a Monitor, a fit's handle or an attached run (run_dir,
# state, step, running and the control methods). Not imported: the widget sits below them.
Watched = Any
_STATIC = Path(__file__).parent / "static"
_PLOTLY: bytes | None = None


def _plotly_source() -> bytes:
    """plotly.js as an ES module, shipped in the package (read once per process)."""
    global _PLOTLY
    if _PLOTLY is None:
        _PLOTLY = (_STATIC / "plotly.js").read_bytes()
    return _PLOTLY


class Dashboard(anywidget.AnyWidget):
    """Live dashboard of a run. `Dashboard.for_monitor(mon)` (with controls) or
    `Dashboard.for_run("runs/exp1")` (read-only).

    >>> Dashboard.for_run("runs/exp1")   # in a notebook cell: the whole run, redrawn
    """

    _esm = _STATIC / "dashboard.js"
    _css = _STATIC / "dashboard.css"
    live = traitlets.Bool(False).tag(sync=True)
    run_dir = traitlets.Unicode("").tag(sync=True)
    # the commands that have a button (controls.page_table()): the page builds its bar from it
    commands: traitlets.List[dict] = traitlets.List([]).tag(sync=True)
    # the trend panels' x axis ("step", "relative", "wall", "tokens"), set by the page's
    # switch; a new dashboard starts with the kernel's last choice (one kernel: one notebook)
    xaxis = traitlets.Unicode("step").tag(sync=True)
    _kept_xaxis = "step"

    def __init__(self, run_dir: str | Path, monitor: Watched | None = None,
                 interval: float = 0.25, **kwargs: Any):
        enable_colab_widgets()  # a dashboard shown without `%load_ext nbwatch`
        kwargs.setdefault("xaxis", Dashboard._kept_xaxis)
        super().__init__(live=monitor is not None, run_dir=str(run_dir),
                         commands=page_table() if monitor is not None else [], **kwargs)
        self.observe(_keep_xaxis, names="xaxis")
        self._dir = Path(run_dir)
        self._monitor = monitor
        self.interval = max(float(interval), 0.25)  # ≤ 4 refreshes/s
        self._feed: Feed | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refreshes = 0  # messages sent by the poll thread, for tests and benchmarks
        self._posted = time.monotonic()  # the last message sent: a tick after TICK_S
        self._status: tuple[str | None, str | None] = (None, None)  # the monitor's state, message
        self._status_sent: tuple[str | None, str | None] = (None, None)
        self.on_msg(self._on_msg)
        self._thread = threading.Thread(target=self._loop, name="nbwatch-dashboard",
                                        daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        # what a saved notebook shows where widgets do not render (GitHub, nbviewer, a diff)
        page = f"{self._dir.name or 'run'}.html"
        return (f"nbwatch dashboard of {self._dir} (reopen it with `%nbwatch {self._dir}`, "
                f"or nbwatch.export_html({str(self._dir)!r}, {page!r}) for a page that opens "
                "anywhere)")

    @classmethod
    def for_monitor(cls, monitor: Watched, **kwargs: Any) -> Dashboard:
        """The live dashboard of a Monitor's run, with its controls."""
        remember(monitor)  # what a bare `%nbwatch` shows
        return cls(monitor.run_dir, monitor=monitor, **kwargs)

    @classmethod
    def for_run(cls, run_dir: str | Path, **kwargs: Any) -> Dashboard:
        """A read-only dashboard of a run folder (finished, or written by another process)."""
        if not is_run_dir(run_dir):
            raise FileNotFoundError(f"{run_dir} holds no nbwatch run; pass a Monitor's run_dir")
        reader = RunReader(run_dir)
        try:
            reader.meta()  # crafted or damaged meta: said here, naming the file
        except sqlite3.OperationalError:
            pass  # the writer is still making the schema: the poll retries
        finally:
            reader.close()
        return cls(run_dir, **kwargs)

    # -- the poll thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self._feed is None and is_run_dir(self._dir):
                    self._feed = Feed(RunReader(self._dir))
                self._read_status()
                try:
                    sent = self.refresh()
                except sqlite3.OperationalError as e:
                    # Not ready yet: the db file exists but the writer is still creating the
                    # schema ("no such table"), or holds a lock. A failed poll moves no cursor.
                    log.debug("nbwatch dashboard: store not ready (%s); retrying", e)
                    sent = False
                if not sent and self._status_changed():
                    self._post({"type": "delta", "panels": {"header": self._header()}})
                elif time.monotonic() - self._posted > TICK_S:  # the page's sign of life
                    self._post({"type": "tick"})
                if self._feed is not None and self._done():
                    self._read_status()
                    # whatever the run committed while it closed, and its final state
                    if not self.refresh() and self._status_changed():
                        self._post({"type": "delta", "panels": {"header": self._header()}})
                    self._post({"type": "tick", "last": True})  # the page hears no more
                    break
                self._stop.wait(self.interval)
        except Exception:  # never die silently; the page keeps what it has
            log.exception("nbwatch dashboard stopped updating")
        finally:
            if self._feed is not None:
                self._feed.tail.reader.close()

    # -- what a followed run says about itself (nbwatch.attach: "waiting", "stale") ------
    def _read_status(self) -> None:
        """Read the monitor-like object's `state` and `message` (when it has them), here in
        the poll thread: an attached run's state reads its store, kept off the main thread."""
        mon = self._monitor
        if mon is None:
            return
        state = getattr(mon, "state", None)
        message = getattr(mon, "message", None)
        self._status = (str(state) if state is not None else None,
                        str(message) if message is not None else None)

    def _status_changed(self) -> bool:
        return self._status != self._status_sent and self._status != (None, None)

    def _header(self, header: dict[str, Any] | None = None) -> dict[str, Any]:
        """The header panel with the monitor's own state and message laid over the store's."""
        if header is None:
            header = self._feed.header() if self._feed is not None else {
                "name": self._dir.name, "step": 0}
        state, message = self._status
        out = dict(header)
        if state is not None:
            out["state"], out["ended"] = state, is_ended(state)
        if message is not None:
            out["message"] = message
        self._status_sent = self._status
        return out

    def _done(self) -> bool:
        mon, feed = self._monitor, self._feed
        if feed is None:
            return False
        if feed.ended:
            return mon is None or not mon.running
        if mon is None and not feed.more:  # read-only view of a run whose writer was killed
            from .store.liveness import STALE_AFTER, run_state

            return run_state(self._dir, feed.meta, None, STALE_AFTER) == STALE
        return False

    def refresh(self) -> bool:
        """Read what is new and send it as one message; True when something was sent.

        While a long history is being read (a reopened run), chunks are folded in without
        sending and one full state goes out when the reader has caught up."""
        feed = self._feed
        if feed is None:
            return False
        with self._lock:
            upd = feed.update()
            caught_up = False
            if feed.history_cut:  # the store dropped steps this mirror holds: read anew
                feed.tail.reader.close()
                feed = self._feed = Feed(RunReader(self._dir))
                upd, caught_up = feed.update(), True
            while feed.more and not self._stop.is_set():
                feed.update()
                caught_up = True
            if caught_up:
                panels = self._with_choices(feed.full())
                panels["header"] = self._header(panels["header"])
                self._post({"type": "full", "to": None, "panels": panels})
            elif upd:
                if "header" in upd or self._status_changed():
                    upd["header"] = self._header(upd.get("header"))
                self._post({"type": "delta", "panels": upd})
            else:
                return False
            self.refreshes += 1
            return True

    def _with_choices(self, panels: dict[str, Any]) -> dict[str, Any]:
        """A full state with what the loss panel's baseline picker offers: the run folders
        beside this one (`nbwatch ls`'s frame), and the one picked."""
        if self._feed is not None:
            panels["loss"] = {**panels.get("loss", {}), "beside": beside(self._dir),
                              "picked": list(self._feed.baselines.picked)}
        return panels

    def _post(self, content: dict[str, Any], extra: list[bytes] | None = None) -> None:
        buffers: list[Any] = list(extra or [])
        msg = pack(content, buffers)
        self.send(msg, buffers=buffers)
        self._posted = time.monotonic()

    # -- messages from the page ---------------------------------------------------------
    def _on_msg(self, _widget: Any, content: dict[str, Any], _buffers: list[bytes]) -> None:
        kind = content.get("type")
        view = content.get("view")
        if kind == "hello":
            if content.get("plotly"):
                self.send({"type": "plotly", "to": view}, buffers=[_plotly_source()])
            with self._lock:
                panels = self._with_choices(self._feed.full()) if self._feed is not None else {}
                if self._monitor is not None:
                    panels["header"] = self._header(panels.get("header"))
                self._post({"type": "full", "to": view, "panels": panels})
        elif kind == "baseline":  # the loss panel's picker: a run beside this one, or none
            offered = beside(self._dir)
            with self._lock:
                feed = self._feed
                if feed is not None:  # read and sent here: a finished run's poll has ended
                    feed.baselines.picked = [
                        str(n) for n in content.get("names") or [] if str(n) in offered]
                    if feed.baselines.refresh(feed.meta, time.time()):
                        self._post({"type": "delta", "panels": {
                            "loss": {"baselines": feed.baselines.panel()}}})
        elif kind == "attention":  # the page opened a head: that one map, read from the store
            self._send_head_map(view, content)
        elif kind == "command":
            try:
                args = content.get("args") or {}
                if not isinstance(args, dict):
                    raise TypeError(f"a command's args are a dict, got {args!r}")
                self.command(str(content.get("kind")), **{str(k): v for k, v in args.items()})
            except (RuntimeError, ValueError, TypeError, OverflowError) as e:
                self.send({"type": "refused", "to": view, "kind": content.get("kind"),
                           "message": str(e)})

    def _send_head_map(self, view: Any, content: dict[str, Any]) -> None:
        """Reply to {type: "attention", step, sample, layer, head, module} with that head's
        [T, S] map (float32, a binary buffer; `map` None where the store has none)."""
        feed = self._feed
        if feed is None:  # nothing read yet: no overview drawn to open a head of
            return
        try:
            step, sample = int(content["step"]), int(content.get("sample") or 0)
            layer, head = int(content.get("layer") or 0), int(content["head"])
        except (KeyError, TypeError, ValueError):
            return
        module = content.get("module")
        if not isinstance(module, str):  # the overview's row: the newest eval's modules
            att = feed.attention
            mods = attention.module_list(att) if att and att["step"] == step else []
            module = mods[layer] if 0 <= layer < len(mods) else None
        reader = feed.tail.reader  # connections per call: usable after the poll has ended
        got = None
        if module is not None:
            try:
                got = attention.head_map(reader.attention(step, sample), module, head)
            except sqlite3.OperationalError as e:  # a busy store: the page asks again
                log.debug("nbwatch dashboard: attention map not read (%s)", e)
                return
        self._post({"type": "attention", "to": view, "step": step, "sample": sample,
                    "layer": layer, "head": head, "module": module, "map": got})

    def command(self, kind: str, **args: Any) -> str:
        """Apply a button: the handle's `send`, with the arguments the command takes, by
        their names in the one table (`nbwatch.controls.COMMANDS`). Returns its id."""
        mon = self._monitor
        if mon is None:
            raise RuntimeError("this dashboard is read-only: it shows a run from its folder")
        return mon.send(kind, "dashboard", **args)

    # -- lifecycle ----------------------------------------------------------------------
    @property
    def polling(self) -> bool:
        """True while the poll thread runs (it ends once the run has ended and all is sent)."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the poll thread (the page keeps what it shows)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def close(self) -> None:
        self.stop()
        super().close()


def _keep_xaxis(change: dict[str, Any]) -> None:
    Dashboard._kept_xaxis = str(change["new"])
