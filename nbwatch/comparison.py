"""Several runs side by side: `nbwatch.compare(run_dirs or a root folder, where=...)`.

Everything here is read from the run folders (`RunReader`); a run still being written is
compared as far as it got.
"""

from __future__ import annotations

import html
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ._flat import flatten
from .store import RunReader, is_run_dir
from .store.liveness import STALE_AFTER, run_state

Where = Mapping[str, Any] | Callable[[dict[str, Any]], bool] | None
DEFAULT_METRICS = ("loss/train", "loss/val")  # compare()'s, less those no run recorded
SKIP_DIRS = {"checkpoints", ".ipynb_checkpoints", "__pycache__", ".git"}


def find_runs(root: str | os.PathLike) -> list[Path]:
    """Run folders at or under `root`, sorted by path (checkpoint folders are not searched)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder; pass the folder that holds your runs")
    found, todo = [], [root]
    while todo:
        d = todo.pop()
        if is_run_dir(d):
            found.append(d)
        todo += [c for c in d.iterdir() if c.is_dir() and c.name not in SKIP_DIRS]
    return sorted(found)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or math.isclose(a, b, rel_tol=1e-9)
    return _hashable(a) == _hashable(b)


def _hashable(v: Any) -> Any:
    return v if isinstance(v, (str, int, float, bool, type(None))) else json.dumps(v, default=str)


def matches(config: Mapping[str, Any], where: Where) -> bool:
    """Does a run's config pass `where`: {key: value or predicate} (keys may be dotted
    paths into nested config), or one predicate on the whole (flattened) config."""
    if where is None:
        return True
    flat = flatten(config)
    if callable(where):
        return bool(where(flat))
    for key, want in where.items():
        if key not in flat:
            return False
        have = flat[key]
        if callable(want):
            if not want(have):
                return False
        elif not _same(have, want):
            return False
    return True


def summarize(reader: RunReader, stale_after: float = STALE_AFTER) -> dict[str, Any]:
    """One row of figures about a run: state, steps, best val loss and its step, last train
    loss, wall time, and for a failed run its error (the first line of the message).
    Reads a few rows, not the run's history."""
    meta = reader.meta()
    best = reader.best("loss/val")
    last = reader.last_value("loss/train")
    first_wall, last_wall = reader.wall_range()
    start = meta.get("started", first_wall)
    state = run_state(reader.run_dir, meta, reader, stale_after)
    error = None
    if state == "failed":
        last_error = reader.last_error()
        lines = str(last_error[0]).strip().splitlines() if last_error else []
        error = lines[0] if lines else "failed without an error message"
    return {
        "name": str(meta.get("name", reader.run_dir.name)),
        "state": state,
        "steps": reader.last_step(),
        "max_steps": meta.get("max_steps"),
        "best_val": best[1] if best else math.nan,
        "best_val_step": best[0] if best else None,
        "last_train": last if last is not None else math.nan,
        "wall_s": (last_wall - float(start)) if last_wall is not None and start else math.nan,
        "error": error,
    }


def config_diff(configs: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """Config keys whose values differ across runs (or that some runs lack): runs × keys."""
    flat = {label: flatten(c) for label, c in configs.items()}
    keys: list[str] = []
    for f in flat.values():
        keys += [k for k in f if k not in keys]
    missing = object()
    differ = []
    for k in keys:
        vals = [f.get(k, missing) for f in flat.values()]
        first = vals[0]
        if any(v is missing for v in vals) or not all(_same(v, first) for v in vals[1:]):
            differ.append(k)
    df = pd.DataFrame({k: [f.get(k) for f in flat.values()] for k in differ},
                      index=pd.Index(list(flat), name="run"), dtype=object)
    return df


class Comparison:
    """Runs overlaid: `.runs`, `.metrics`, `.df`, `.config_diff`, `.summary`, `.figure()`;
    `.note` says why `compare()` chose fewer metrics than its default (None if it did not).

    `.df` is long: one row per (run, step, metric) with `wall` (seconds since the run
    started) beside `step`; `.wide(metric)` aligns runs column by column on `x`.
    """

    def __init__(self, dirs: Sequence[Path], labels: Sequence[str], metrics: Sequence[str],
                 x: str):
        self.run_dirs = list(dirs)
        self.labels = list(labels)
        self.metrics = list(metrics)
        self.x = x
        self.note: str | None = None  # why compare() chose fewer metrics, e.g. no loss/val
        self._unrecorded: list[str] = []  # the default metrics no run recorded
        self._readers = [RunReader(d) for d in dirs]
        self._df: pd.DataFrame | None = None
        self._df_at: list[int] = []  # each run's last step when `_df` was read

    @property
    def runs(self) -> list[str]:
        """The labels of the compared runs, in order (the columns of `.wide()`)."""
        return list(self.labels)

    @property
    def configs(self) -> dict[str, dict[str, Any]]:
        return {lab: r.config() for lab, r in zip(self.labels, self._readers)}

    @property
    def df(self) -> pd.DataFrame:
        """Long frame: run, step, wall (s since the run's start), metric, value (read
        again once a run still being written has recorded more)."""
        at = [r.last_step() for r in self._readers]
        if self._df is None or at != self._df_at:
            self._df_at = at
            parts = []
            for label, r in zip(self.labels, self._readers):
                long = r.scalars_long(self.metrics)
                walls = r.walls()
                start = r.meta().get("started", walls.iloc[0] if len(walls) else 0.0)
                part = pd.DataFrame({
                    "run": label,
                    "step": long["step"].to_numpy(),
                    "wall": walls.reindex(long["step"]).to_numpy(dtype=float) - float(start),
                    "metric": long["key"].to_numpy(),
                    "value": long["value"].to_numpy(),
                })
                parts.append(part.sort_values(["metric", "step"], kind="stable"))
            cols = ["run", "step", "wall", "metric", "value"]
            self._df = (pd.concat(parts, ignore_index=True) if parts
                        else pd.DataFrame(columns=cols))
        return self._df

    def wide(self, metric: str | None = None) -> pd.DataFrame:
        """One metric aligned across runs: index `x` (step or wall), one column per run."""
        metric = metric or self.metrics[0]
        d = self.df[self.df.metric == metric]
        idx = "step" if self.x == "step" else "wall"
        out = d.pivot_table(index=idx, columns="run", values="value", aggfunc="last")
        out.columns.name = None
        return out[[lab for lab in self.labels if lab in out.columns]]

    @property
    def config_diff(self) -> pd.DataFrame:
        """Config keys that differ across the runs (runs × keys; None where a run lacks one)."""
        return config_diff(self.configs)

    @property
    def summary(self) -> pd.DataFrame:
        """Per run: state, steps, best val loss and its step, last train loss, wall time (s)."""
        rows = [summarize(r) for r in self._readers]
        return pd.DataFrame(rows, index=pd.Index(self.labels, name="run"))

    def figure(self, max_points: int = 5000) -> Any:
        """A plotly figure: one row per metric, one colour per run, x = step or wall time."""
        import plotly.graph_objects as go
        from plotly.colors import qualitative
        from plotly.subplots import make_subplots

        from .panels.downsample import bucket_width, reduce

        fig = make_subplots(rows=len(self.metrics), cols=1, shared_xaxes=True,
                            vertical_spacing=0.08,
                            subplot_titles=[html.escape(m) for m in self.metrics])
        palette = qualitative.Plotly
        df, shown = self.df, set()
        for i, label in enumerate(self.labels):
            color = palette[i % len(palette)]
            for row, metric in enumerate(self.metrics, start=1):
                d = df[(df.run == label) & (df.metric == metric)]
                if d.empty:
                    continue
                steps, v = d["step"].to_numpy(), d["value"].to_numpy()
                s_kept, v_kept = reduce(steps, v, bucket_width(int(steps[-1]), max_points,
                                                                int(steps[0])))
                xs = (s_kept if self.x == "step"
                      else pd.Series(d["wall"].to_numpy(), index=steps)[s_kept].to_numpy())
                span = int(steps[-1]) - int(steps[0]) + 1
                sparse = len(steps) < 0.2 * span  # e.g. loss/val
                fig.add_trace(go.Scatter(
                    x=xs, y=v_kept.astype(np.float64), name=html.escape(label),
                    legendgroup=label, showlegend=label not in shown,
                    mode="lines+markers" if sparse else "lines",
                    line={"color": color, "width": 1.5}, marker={"size": 5},
                ), row=row, col=1)
                shown.add(label)
        fig.update_xaxes(title_text="step" if self.x == "step" else "seconds since start",
                         row=len(self.metrics), col=1)
        fig.update_layout(height=260 * len(self.metrics) + 60, template="plotly_white",
                          margin={"l": 60, "r": 20, "t": 40, "b": 40})
        return fig

    def _ipython_display_(self) -> None:
        from IPython.display import display

        from .notebook import in_notebook as _in_notebook

        if _in_notebook():  # JupyterLab draws it offline (jupyterlab-plotly's renderer);
            display(self.figure())  # in a terminal plotly would open a browser instead
            if self.note:
                print(self.note)
        else:
            print(repr(self))  # the note included
        display(self.summary)
        diff = self.config_diff
        if not diff.empty:
            display(diff)

    def close(self) -> None:
        for r in self._readers:
            r.close()

    def __repr__(self) -> str:
        on = f" on {', '.join(self.metrics)}"
        if self._unrecorded:
            on += f" (no run recorded {', '.join(self._unrecorded)})"
        return f"<nbwatch.Comparison of {len(self.labels)} runs{on}: {', '.join(self.labels)}>"


LS_COLUMNS = ["run", "state", "steps", "max_steps", "best_val", "best_val_step",
              "last_train", "wall_s", "error"]
_ORDER = {"name": lambda r: r["run"],
          "best": lambda r: (math.isnan(r["best_val"]), r["best_val"]),
          "steps": lambda r: -r["steps"]}


def list_runs(root: str | os.PathLike = "runs", where: Where = None, sort: str = "name",
              keys: Sequence[str] | None = None, max_keys: int = 4,
              stale_after: float = STALE_AFTER) -> pd.DataFrame:
    """The runs under `root`, one row each: run (its folder under root), state, steps,
    max_steps, best_val, best_val_step, last_train, wall_s, error (the first line of a
    failed run's error, else None), then config columns: `keys`,
    else those that differ between runs (all of them for one run), at most `max_keys`.
    What `nbwatch ls` and `%nbwatch ls` print. A damaged run is skipped with a warning; one
    whose config is not a JSON object is listed without it, with a warning."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder; nbwatch ls ROOT lists the runs "
                                "under ROOT")
    if sort not in _ORDER:
        raise ValueError(f"sort must be one of {sorted(_ORDER)}, got {sort!r}")
    rows, configs = [], {}
    for d in find_runs(root):
        try:
            reader = RunReader(d)
            config = reader.config()
            if not matches(config, where or None):
                continue
            row = summarize(reader, stale_after=stale_after)
        except Exception as e:  # noqa: BLE001 - one damaged run must not hide the others
            warnings.warn(f"nbwatch ls: skipped {d}: {type(e).__name__}: {e}", stacklevel=2)
            continue
        label = str(d.relative_to(root)) if d != root else d.resolve().name
        rows.append({"run": label, **{k: row[k] for k in LS_COLUMNS[1:]}})
        configs[label] = config
    rows.sort(key=_ORDER[sort])
    if keys is None:
        keys = list(config_diff(configs).columns) if len(configs) > 1 else []
        keys = keys or (list(flatten(next(iter(configs.values())))) if configs else [])
    keys = list(keys)[:max_keys]
    for r in rows:
        flat = flatten(configs[r["run"]])
        r.update({k: flat.get(k) for k in keys})
    return pd.DataFrame(rows, columns=LS_COLUMNS + [k for k in keys if k not in LS_COLUMNS])


def _labels(dirs: Sequence[Path], root: Path | None) -> list[str]:
    names = [d.resolve().name for d in dirs]  # "." is named after the folder it is
    if len(set(names)) == len(names):
        return names
    if root is not None:
        return [str(d.relative_to(root)) if d != root else d.resolve().name for d in dirs]
    return [str(d) for d in dirs]


def compare(
    runs: str | os.PathLike | Iterable[str | os.PathLike],
    where: Where = None,
    metrics: str | Sequence[str] | None = None,
    x: str = "step",
) -> Comparison:
    """Overlay several runs: a root folder (every run under it) or a list of run folders.

    `where` keeps the runs whose config matches: {"lr": 3e-4} (equality; dotted keys reach
    nested config; a value may be a predicate) or a predicate on the whole config dict.
    `metrics` are the scalars overlaid; by default loss/train and loss/val, or loss/train
    alone when no compared run recorded loss/val (no `val_fn`), which `.note` and the
    comparison's repr say. `x` is "step" or "wall" (seconds since each run started).

    >>> cmp = nbwatch.compare("runs", where={"batch_size": 32}, metrics=["loss/val"])
    >>> cmp.summary.sort_values("best_val")
    >>> cmp.config_diff            # which config keys differ between them
    >>> cmp                        # in a notebook: the overlay figure and both tables
    """
    if x not in ("step", "wall"):
        raise ValueError(f"x must be 'step' or 'wall', got {x!r}")
    if isinstance(metrics, str):
        metrics = [metrics]
    if metrics is not None and not metrics:
        raise ValueError("metrics is empty; name at least one scalar, e.g. 'loss/train'")
    root: Path | None = None
    if isinstance(runs, (str, os.PathLike)):
        root = Path(runs)
        dirs = find_runs(root)
        if not dirs:
            raise FileNotFoundError(f"no nbwatch runs under {root}")
    else:
        dirs = [Path(d) for d in runs]
        given: dict[Path, Path] = {}
        for d in dirs:
            if not is_run_dir(d):
                raise FileNotFoundError(f"{d} holds no nbwatch run; pass run folders written "
                                        "by nbwatch.Monitor, or one root folder")
            same = given.setdefault(d.resolve(), d)
            if same is not d:
                raise ValueError(f"compare: the run folder {d.resolve()} is given twice "
                                 f"({str(same)!r}, {str(d)!r}); give each run once")
        if not dirs:
            raise ValueError("no runs given; pass a list of run folders or a root folder")
    configs = {}
    for d in dirs:
        try:
            configs[d] = RunReader(d).config()
        except Exception as e:  # noqa: BLE001 - one damaged run must not hide the others
            warnings.warn(f"compare: skipped {d}: {type(e).__name__}: {e}", stacklevel=2)
    kept = [d for d in dirs if d in configs and matches(configs[d], where)]
    if not kept:
        seen = ""
        if isinstance(where, Mapping):
            vals = {k: sorted({repr(flatten(c).get(k)) for c in configs.values()})
                    for k in where}
            seen = "; values seen: " + ", ".join(f"{k} in {{{', '.join(v)}}}"
                                                  for k, v in vals.items())
        raise ValueError(f"none of the {len(dirs)} runs matches where={where!r}{seen}")
    cmp = Comparison(kept, _labels(kept, root), metrics or DEFAULT_METRICS, x)
    known = set()
    for r in cmp._readers:
        known.update(r.keys())
    if metrics is None:
        cmp.metrics = [m for m in DEFAULT_METRICS if m in known] or list(DEFAULT_METRICS)
        missing = [m for m in DEFAULT_METRICS if m not in known]
        if missing and len(missing) < len(DEFAULT_METRICS):
            cmp._unrecorded = missing
            cmp.note = (f"no compared run recorded {', '.join(missing)}: comparing "
                        f"{', '.join(cmp.metrics)} only (pass metrics=[...] to choose)")
        metrics = cmp.metrics
    unknown = [m for m in metrics if m not in known]
    if unknown:
        cmp.close()
        if not known:  # nothing recorded yet: no metric to name
            raise ValueError(f"no compared run has recorded a step yet ({', '.join(cmp.labels)}"
                             "): compare them once they have")
        shown = ", ".join(sorted(known)[:12])
        raise ValueError(f"no compared run recorded {', '.join(map(repr, unknown))}; "
                         f"known scalars include: {shown}; pass metrics=[...] to choose")
    return cmp
