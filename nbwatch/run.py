"""A recorded run, read back from its folder: `nbwatch.open_run(run_dir)`."""

from __future__ import annotations

import difflib
import sqlite3
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .alerts.postmortem import SPIKE_COLUMNS, spikes_of  # noqa: F401  (their home; re-exported)
from .alerts.postmortem import from_reader as _spikes
from .lifecycle import FolderState, is_ended
from .notebook import current_cell, in_notebook
from .records import branches
from .store import DB_NAME, RunReader
from .store.liveness import STALE_AFTER, run_state

# a run's events: `branch` is N for those a rewind set aside as branch N, 0 on the kept line
EVENT_COLUMNS = ["step", "wall", "kind", "severity", "message", "data", "branch"]


class Readout:
    """`df`, `events`, `export_html`, `diagnose()` and `show()` of a run still being written
    (a Monitor, a fit's handle): subclasses give `run_dir` and `_run()`, the Run so far or
    None."""

    run_dir: Path

    def _run(self) -> Run | None:
        raise NotImplementedError

    @property
    def df(self) -> pd.DataFrame:
        """One row per step (index `step`), one column per scalar."""
        run = self._run()
        return run.df if run is not None else pd.DataFrame(index=pd.Index([], name="step"))

    def system(self, keys: list[str] | str | None = None, start: float | None = None,
               stop: float | None = None) -> pd.DataFrame:
        """Every system sample so far, on its wall-clock timeline (see `Run.system`)."""
        run = self._run()
        if run is None:
            return pd.DataFrame(columns=["step"], index=pd.Index([], name="wall"))
        return run.system(keys, start, stop)

    @property
    def events(self) -> pd.DataFrame:
        """Alerts, actions, checkpoints and state changes: step, kind, severity, message,
        data, branch (`Run.events`)."""
        run = self._run()
        if run is None:
            return pd.DataFrame(columns=EVENT_COLUMNS)
        return run.events

    @property
    def spikes(self) -> pd.DataFrame:
        """One row per `loss_spike` alert, with its post-mortem (see `Run.spikes`)."""
        run = self._run()
        return run.spikes if run is not None else pd.DataFrame(columns=SPIKE_COLUMNS)

    @property
    def branches(self) -> pd.DataFrame:
        """The steps each rewind went back over (`rewind/<n>/loss/train`, `/loss/val`)."""
        run = self._run()
        return run.branches if run is not None else pd.DataFrame(index=pd.Index([], name="step"))

    def export_html(self, path: str | Path, *, environment: bool = True) -> Path:
        """Write this run (so far) as one self-contained HTML file; returns its path.
        `environment=False` leaves out host, pid, working directory, argv and versions."""
        from .export import export_html

        self._run()  # commits what is queued
        return export_html(self.run_dir, path, environment=environment)

    def diagnose(self) -> list:
        """Findings that explain the run so far (val periodicity, step-time bottleneck…),
        and each loss spike's post-mortem as a short timeline; shown as text.

        >>> print(mon.diagnose())
        """
        from .alerts.diagnostics import diagnose

        return diagnose(self.df, self.spikes)

    def show(self) -> Any:
        """Display the live dashboard of this run, with its controls, in the notebook."""
        from IPython.display import display

        from .widget import Dashboard

        dash = Dashboard.for_monitor(self)
        display(dash)
        self._shown_in = current_cell()
        return dash

    _shown_in: int | None = None  # the notebook cell that last showed the dashboard

    def _ipython_display_(self) -> None:
        """As a cell's result (`mon`, a cell ending in `mon.start(...)`): the dashboard,
        unless this very cell showed it already; its one line outside a notebook."""
        if not in_notebook():
            print(repr(self))
        elif self._shown_in is None or self._shown_in != current_cell():
            self.show()


class RunNotStarted(RuntimeError):
    """The run folder's database exists but its writer has not created the store yet."""


def started_run(run_dir: Path) -> Run | None:
    """The run in `run_dir`, or None before its writer has created it (a run starting)."""
    if not (Path(run_dir) / DB_NAME).is_file():
        return None
    try:
        return Run(run_dir)
    except RunNotStarted:
        return None


class Run:
    """Read-only access to a run folder, finished or still being written.

    >>> run = nbwatch.open_run("runs/exp1")
    >>> run.df["loss/train"].tail()
    >>> steps, edges, counts = run.histograms("weight/blocks.0.attn.qkv")
    """

    def __init__(self, run_dir: str | Path):
        self.reader = RunReader(run_dir)
        self.run_dir = self.reader.run_dir
        try:
            self.reader.meta()
        except sqlite3.OperationalError as e:
            raise RunNotStarted(
                f"{self.reader.path} holds no nbwatch records ({e}): its writer has not"
                " created them yet, or was cut off before it did") from e

    @property
    def meta(self) -> dict[str, Any]:
        return self.reader.meta()

    @property
    def name(self) -> str:
        return str(self.meta.get("name", self.run_dir.name))

    @property
    def config(self) -> dict[str, Any]:
        return self.reader.config()

    @property
    def environment(self) -> dict[str, Any]:
        return self.meta.get("environment", {})

    @property
    def state(self) -> str:
        """What the writer last recorded, or "stale" where that says live but the writer is
        gone (killed: its folder lock is free) or silent for `STALE_AFTER` seconds."""
        meta = self.meta
        if "state" not in meta:
            return FolderState.UNKNOWN
        return run_state(self.run_dir, meta, self.reader, STALE_AFTER)

    @property
    def step(self) -> int:
        return self.reader.last_step()

    @property
    def df(self) -> pd.DataFrame:
        """One row per step (index `step`), one column per scalar: the live line (the steps
        a rewind went back over are in `branches`)."""
        df = self.reader.df()
        live = df[[c for c in df.columns if not c.startswith("rewind/")]]
        if len(live.columns) < len(df.columns):  # the rows a branch alone holds are not live
            # (nor those where only the sampler read the system while the branch ran)
            trained = [c for c in live.columns if not c.startswith("system/")]
            live = live[live[trained].notna().any(axis=1)]
        return live

    @property
    def branches(self) -> pd.DataFrame:
        """The steps each rewind went back over: columns `rewind/<n>/loss/train` (and
        `/loss/val`), one row per step; empty when the run never rewound."""
        df = self.reader.df()
        return df[[c for c in df.columns if c.startswith("rewind/")]].dropna(how="all")

    def scalars(self, keys: list[str] | str | None = None, start: int | None = None,
                stop: int | None = None) -> pd.DataFrame:
        """`df` restricted to `keys` and to steps `start <= step < stop`; reads only the
        stored blocks that hold them (a window of a long run costs the window).

        A key the run has not recorded (not yet, or a typo) comes back as a column of NaN,
        with a warning that names the closest recorded keys.

        >>> run.scalars(["loss/train", "loss/val"], start=90_000)
        """
        asked = self._asked(keys, "scalars")
        df = self.reader.scalars(asked, start, stop)
        missing = [k for k in asked or [] if k not in df.columns]
        return df.reindex(columns=[*df.columns, *missing]) if missing else df

    def system(self, keys: list[str] | str | None = None, start: float | None = None,
               stop: float | None = None) -> pd.DataFrame:
        """Every system sample (GPU/CPU/RAM figures, one per `system_interval`), oldest
        first, with a wall time in [start, stop) (epoch seconds): index `wall`, column
        `step` (the steps completed when it was taken: a long step holds many samples),
        then one column per `system/...` key. `df`'s `system/...` columns hold, per step,
        the newest of these taken at that step.

        >>> s = run.system(["system/gpu0/util"])
        >>> s.index = pd.to_datetime(s.index, unit="s")   # clock times
        """
        asked = self._asked(keys, "system")
        df = self.reader.system(asked, start, stop)
        missing = [k for k in asked or [] if k not in df.columns]
        return df.reindex(columns=[*df.columns, *missing]) if missing else df

    def _asked(self, keys: list[str] | str | None, method: str) -> list[str] | None:
        """`keys` as a list (one key may come bare). A key the run has not recorded is
        warned of where it looks like a typo of one it has, or where the run has ended (a
        live run's `loss/val` before its first eval is merely not there yet)."""
        if keys is None:
            return None
        asked = [keys] if isinstance(keys, str) else list(keys)
        known = self.reader.keys()
        ended: bool | None = None
        for k in dict.fromkeys(asked):
            if k in known:
                continue
            near = difflib.get_close_matches(k, known, n=3, cutoff=0.8)
            if not near:
                if ended is None:
                    state = self.state
                    ended = is_ended(state) or state == FolderState.STALE
                if not ended:
                    continue
            hint = (f"did you mean {', '.join(map(repr, near))}?" if near
                    else "run.df.columns lists those it has")
            where = (" (system figures are its `system/...` keys)"
                     if method == "system" and not k.startswith("system/") else "")
            warnings.warn(f"nbwatch: run.{method}: {k!r} is not recorded in {self.run_dir}"
                          f"{where}; its column is NaN; {hint}", stacklevel=3)
        return asked

    @property
    def events(self) -> pd.DataFrame:
        """Alerts, actions, checkpoints and state changes, oldest first: step, wall, kind,
        severity, message, data, and `branch`: N for an event whose step rewind N went back
        over (set aside with that branch's steps, `branches`), 0 on the line the run kept."""
        ev = self.reader.events().drop(columns=["id"]).reset_index(drop=True)
        ev["branch"] = branches(ev.to_dict("records")) if len(ev) else []
        return ev[EVENT_COLUMNS]

    @property
    def spikes(self) -> pd.DataFrame:
        """One row per `loss_spike` alert: step, loss, the rolling median and the robust z
        it was judged against, and batches: the identities (`{"step", "epoch", "index",
        "hash"}`, as far as known) of the batches of the spike step and the steps before.
        Then its post-mortem, from the recorded series of the steps before it
        (`nbwatch.alerts.postmortem`): `first` (the signals that moved first) and `lead` (how many
        steps before), `first_layers` (the layers whose gradient norm rose earliest above 3×
        its rolling median, within the 20 steps before), `first_updates` (the same for the
        update ratios, where they are recorded every step, `update_every=1`; else None),
        `grad_z`, `grad_rose`,
        `loss_rose`, `lr` and `lr_change`, `alerts_before` (the rules that fired before it,
        and when).

        >>> run.spikes.batches.iloc[0][-1]   # the spike step's batch
        >>> run.spikes[["step", "first", "lead"]]
        """
        return _spikes(self.reader)

    @property
    def samples(self) -> pd.DataFrame:
        return self.reader.samples()

    def diagnose(self) -> list:
        """As `Monitor.diagnose()`: findings, and each loss spike's post-mortem timeline."""
        from .alerts.diagnostics import diagnose

        return diagnose(self.df, self.spikes)

    def histograms(self, name: str) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """(steps, bin_edges per step, counts [steps, bins]) of one histogram series."""
        return self.reader.histograms(name)

    def attention(self, step: int | None = None, sample: int = 0) -> dict[str, np.ndarray]:
        """{module path: weights [heads, T, S]} at the newest (or given) eval step; {} for a
        run with no maps (a model without attention). A step or a sample without maps is a
        KeyError that names those recorded."""
        maps = self.reader.attention(step, sample)
        if maps:
            return maps
        steps = self.reader.attention_steps()  # only to say why there are none
        if not steps:
            return maps
        at = steps[-1] if step is None else step
        if at not in steps:
            shown = ", ".join([*map(str, steps[:5]), *(["…"] if len(steps) > 8 else []),
                               *map(str, steps[max(5, len(steps) - 3):])])
            raise KeyError(f"no attention maps at step {step}: this run has them at steps "
                           f"{shown} ({len(steps)} evals)")
        n = self.reader.attention_samples(at)
        raise KeyError(f"no attention sample {sample} at step {at}: its eval recorded "
                       f"{n} (sample=0" + (f" to {n - 1})" if n > 1 else ")"))

    def export_html(self, path: str | Path, *, environment: bool = True) -> Path:
        """Write this run as one self-contained HTML file (opens offline); returns its path.
        `environment=False` leaves out host, pid, working directory, argv and versions."""
        from .export import export_html

        return export_html(self.run_dir, path, environment=environment)

    def show(self) -> Any:
        """Display this run's dashboard (read-only) in the notebook."""
        from IPython.display import display

        from .widget import Dashboard

        dash = Dashboard.for_run(self.run_dir)
        display(dash)
        return dash

    def __repr__(self) -> str:
        return f"<nbwatch.Run {self.name!r} {self.state} at step {self.step} in {self.run_dir}>"


def open_run(run_dir: str | Path) -> Run:
    """Reopen a run folder written by `nbwatch.Monitor` (finished, crashed or running)."""
    return Run(run_dir)
