"""One self-contained HTML file of a run: `nbwatch.export_html(run_dir, "run.html")`.

The page holds the dashboard's state as JSON (built by the same `Feed` and panel builders
as the live widget, so the two cannot disagree), plotly.js (the bundle the widget ships),
and `static/export.js`, which draws it with the widget's own JS views. No request leaves the
file: a Content-Security-Policy forbids any, and every string from a user or a model is
JSON inside a `<script type="application/json">` (`<`, `>`, `&`, U+2028/9 escaped) that the
page reads with `JSON.parse` and writes with `textContent` only.

Size is bounded whatever the run length: each series is the dashboard's min/max-keeping
downsample (≤ 5,000 points), histograms are thinned to a fixed number of columns, and the
tables keep their newest rows.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import os
import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .alerts.postmortem import newest_of as newest_spikes
from .panels import Feed
from .panels import report as rpt
from .panels.downsample import MAX_POINTS
from .panels.weights import thin
from .panels.wire import pack
from .records import branches
from .store import DB_NAME, RunReader

_STATIC = Path(__file__).parent / "static"
MAX_HIST_COLUMNS = 2400  # all layers together; each layer keeps at least 16
_UNSAFE_IN_SCRIPT = re.compile(r"</script|<!--", re.IGNORECASE)
_JSON_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026",
                 0x2028: "\\u2028", 0x2029: "\\u2029"}


def export_html(run_dir: str | os.PathLike, path: str | os.PathLike, *,
                environment: bool = True) -> Path:
    """Write the run in `run_dir` as one HTML file at `path` (opens offline, anywhere).

    `path` may be a folder (the file is `report.html` in it). `environment=False` leaves
    out where the run ran: host, pid, working directory, command line, versions and
    devices (for a snapshot you share).

    >>> nbwatch.export_html("runs/exp1", "exp1.html")
    PosixPath('exp1.html')
    """
    out = _target(Path(run_dir), Path(path))
    reader = RunReader(run_dir)
    try:
        reader.meta()  # crafted or damaged meta: an error naming the file, before any page
        state = snapshot(reader, environment=environment)
    finally:
        reader.close()
    name = str(state["name"]) or Path(run_dir).name
    out.parent.mkdir(parents=True, exist_ok=True)
    _write(out, render(state, name), Path(run_dir).absolute().resolve())
    return out


def _write(out: Path, text: str, run: Path) -> None:
    """Write the page at `out`: a new or regular file through a temporary file and a
    rename (a reader never sees half a file); a symlink, a FIFO, a device or a pipe
    (`-o /dev/stdout`) written through, so that it stays what it is."""
    if _through(out, run):
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        return
    # a new name, created exclusively: a link planted at a fixed name is not followed
    tmp = out.with_name(f"{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w",
                  encoding="utf-8") as f:
            f.write(text)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)


def _through(out: Path, run: Path) -> bool:
    """Whether `out` is written through (a symlink, or not a regular file) rather than
    replaced. Never inside the run folder: a folder from someone else may hold a link or a
    FIFO named report.html, and its default export must not write where that leads (nor
    wait on it)."""
    folder = out.parent.resolve()
    if folder == run or run in folder.parents:
        return False
    return out.is_symlink() or (out.exists() and not out.is_file())


def _target(run_dir: Path, path: Path) -> Path:
    """Where the export goes; refuses a path that would destroy the run or another file."""
    if path.is_dir():
        path = path / "report.html"
    full, run = path.absolute().resolve(), run_dir.absolute().resolve()
    owned = [run / n for n in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", "log.jsonl")]
    if full in owned or run / "checkpoints" in full.parents:
        raise ValueError(
            f"refusing to export over {path}: it holds the run itself; write the export"
            f" beside it, e.g. {run / 'report.html'}")
    if full.is_file() and full.suffix.lower() not in (".html", ".htm"):
        raise FileExistsError(
            f"refusing to overwrite {path}: it is not an .html file; pass a path ending in"
            " .html (an existing .html export is replaced)")
    return path


# -- the state ----------------------------------------------------------------------------
PRIVATE_META = ("environment", "pid", "host")  # where the run ran: left out on request


def snapshot(reader: RunReader, max_points: int = MAX_POINTS,
             max_columns: int = MAX_HIST_COLUMNS, now: float | None = None,
             environment: bool = True) -> dict[str, Any]:
    """{name, panels (the dashboard's full state), report (summary and tables)}."""
    now = time.time() if now is None else now
    feed = Feed(reader, max_points, maps=True)  # no kernel to fetch a head's map from
    feed.update(now)
    while feed.more:  # the whole history, a chunk at a time, folded into bounded series
        feed.update(now)
    if not environment:
        feed.meta = {k: v for k, v in feed.meta.items() if k not in PRIVATE_META}
    panels = feed.full(now)
    if not environment:  # the baselines' folders, named without where they lie
        feed.meta["baselines"] = [Path(p).name for p in feed.meta.get("baselines") or []]
        for b in panels.get("loss", {}).get("baselines") or []:
            b["path"] = Path(b["path"]).name
    _cap_columns(panels.get("weights", {}), max_columns)
    meta = feed.meta
    state = {"name": str(meta.get("name", reader.run_dir.name)), "panels": panels,
             "report": _report(reader, meta, feed.step, panels["header"].get("elapsed_s"))}
    return state if environment else _unplaced(state, reader.run_dir)


_TRACE_FILE = re.compile(r'File "([^"]+)"')


def _unplaced(obj: Any, run_dir: Path) -> Any:
    """`obj` with where the run ran taken out of its text: a traceback's file paths cut to
    their file names, the run folder's path to its name (the environment left out)."""
    where = str(run_dir.absolute())
    if isinstance(obj, str):
        obj = _TRACE_FILE.sub(lambda m: f'File "{Path(m.group(1)).name}"', obj)
        return obj.replace(where, run_dir.name) if where in obj else obj
    if isinstance(obj, dict):
        return {k: _unplaced(v, run_dir) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unplaced(v, run_dir) for v in obj]
    return obj


def _cap_columns(weights: dict[str, Any], budget: int) -> None:
    """Thin every layer's histogram columns so all layers together hold ≤ `budget`."""
    hist = weights.get("hist") or {}
    if not hist:
        return
    per = max(budget // len(hist), 16)
    for h in hist.values():
        n = len(h["steps"])
        if n > per:
            keep = np.array([i for _, i in thin(list(zip(h["steps"].tolist(), range(n))),
                                                per)])
            for k in ("steps", "edges", "counts"):
                h[k] = h[k][keep]


def _report(reader: RunReader, meta: Mapping[str, Any], step: int,
            wall_s: float | None) -> dict[str, Any]:
    """The summary and tables; `wall_s`: the header's elapsed time (one duration)."""
    alerts, n_alerts = reader.events_of(rpt.TABLE_KINDS, rpt.MAX_ROWS)
    ckpts, n_ckpts = reader.events_of(("checkpoint",), rpt.MAX_ROWS)
    rewinds = [e for e in reader.events_of(("action",), 1_000_000)[0]
               if e["data"].get("command") == "rewind"]
    if rewinds:  # the checkpoints a rewind went back over were set aside with its branch
        told = sorted(ckpts + rewinds, key=lambda e: e["id"])
        for e, n in zip(told, branches(told)):
            e["branch"] = n
    folder = reader.run_dir / "checkpoints"
    kept = ({p.relative_to(folder).as_posix()
             for p in [*folder.iterdir(), *folder.glob("rewind/*/*")]}
            if folder.is_dir() else None)
    for e in ckpts:  # a framework's own save (checkpoint-N, a .ckpt) lies outside the folder
        path = Path(str((e.get("data") or {}).get("path", "")))
        if path.name and folder not in path.parents:
            e["present"] = path.exists()

    best = reader.best("loss/val")
    best_val = (best[1], best[0]) if best else None
    tokens_seen = reader.series(["tokens/real"]).get("tokens/real")
    tokens = float(np.nansum(tokens_seen[1])) if tokens_seen is not None else None
    return {
        "summary": rpt.summary(meta, step, (best_val[1], best_val[0]) if best_val else None,
                               None if tokens is None else float(tokens), wall_s),
        "events": rpt.events_table(alerts, n_alerts),
        "spikes": rpt.spikes_table(*newest_spikes(reader, rpt.MAX_ROWS)),
        "checkpoints": rpt.checkpoints_table(ckpts, n_ckpts, kept),
        "config": rpt.key_values(meta.get("config")),
        "environment": rpt.key_values(meta.get("environment")),
    }


# -- the page -----------------------------------------------------------------------------
def script_json(obj: Any) -> str:
    """JSON safe inside `<script type="application/json">`: no `<`, `>`, `&`, U+2028/9 left."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.translate(_JSON_ESCAPES)


def _static(name: str) -> str:
    return (_STATIC / name).read_text(encoding="utf-8")


def render(state: Mapping[str, Any], name: str) -> str:
    """The HTML page of a `snapshot()`."""
    buffers: list[memoryview] = []
    panels = pack(state["panels"], buffers)
    data = script_json({"version": 1, "panels": panels, "report": state["report"],
                        "buffers": [base64.b64encode(b).decode("ascii") for b in buffers]})
    plotly = _static("plotly.js")
    enc = ""
    if _UNSAFE_IN_SCRIPT.search(plotly):  # would end the <script> early: carry it as base64
        plotly, enc = base64.b64encode(plotly.encode()).decode("ascii"), ' data-encoding="base64"'
    app, css = _static("export.js"), _static("dashboard.css")
    if _UNSAFE_IN_SCRIPT.search(app) or "</style" in css.lower():
        raise RuntimeError("nbwatch/static holds a bundle that cannot be inlined; rebuild js/")
    # Only this one inline script may run (its hash), plotly.js is imported from a blob: URL
    # made from the page's own text; nothing may be fetched from anywhere.
    digest = base64.b64encode(hashlib.sha256(app.encode()).digest()).decode("ascii")
    csp = (f"default-src 'none'; script-src 'sha256-{digest}' blob:; "
           "style-src 'unsafe-inline'; img-src data: blob:; font-src data:")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{csp}\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<meta name=\"generator\" content=\"nbwatch\">\n"
        f"<title>{html.escape(name)} · nbwatch</title>\n"
        f"<style>\nbody {{ margin: 0; background: #fff; }}\n{css}</style>\n</head>\n<body>\n"
        "<div id=\"nbw-app\"></div>\n"
        f"<script type=\"application/json\" id=\"nbw-state\">{data}</script>\n"
        f"<script type=\"text/plain\" id=\"nbw-plotly\"{enc}>{plotly}</script>\n"
        f"<script type=\"module\">{app}</script>\n</body>\n</html>\n"
    )
