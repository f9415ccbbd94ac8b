"""The HTML export: one self-contained file, bounded in size, hostile strings only escaped."""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

import nbwatch
from nbwatch.cli import main
from nbwatch.export import export_html, script_json, snapshot
from nbwatch.store import RunReader
from tests.conftest import tiny_step
from tests.export_run import IMG, SCRIPT, write_run


class Page(HTMLParser):
    """Tags and attributes of a page (a <script>'s text is data, not tags)."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: dict[str, str] = {}
        self._in: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "script":
            self._in = a.get("id") or a.get("type") or ""
            self.scripts[self._in] = ""

    def handle_data(self, data):
        if self._in is not None:
            self.scripts[self._in] += data

    def handle_endtag(self, tag):
        if tag == "script":
            self._in = None


def exported(tmp_path: Path, steps: int = 200) -> tuple[str, Page]:
    run = write_run(tmp_path / "run", steps=steps)
    out = export_html(run, tmp_path / "out" / "run.html")
    text = out.read_text(encoding="utf-8")
    return text, Page(text)


def state_of(page: Page) -> dict:
    return json.loads(page.scripts["nbw-state"])


def test_file_is_self_contained(tmp_path):
    text, page = exported(tmp_path)
    tags = {t for t, _ in page.tags}
    assert tags <= {"html", "head", "meta", "title", "style", "body", "div", "script"}, tags
    for tag, attrs in page.tags:  # nothing to load: no src, href, link, iframe, object
        assert not {"src", "href", "action", "srcset", "data"} & set(attrs), (tag, attrs)
    assert re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", text.split("nbw-plotly")[0]) \
        is None
    # plotly.js inlined: the very bundle the widget ships; the page's JS is static/export.js.
    static = Path(nbwatch.__file__).parent / "static"
    assert page.scripts["nbw-plotly"] == (static / "plotly.js").read_text(encoding="utf-8")
    assert page.scripts["module"] == (static / "export.js").read_text(encoding="utf-8")
    # A Content-Security-Policy allows no fetch and only the page's own script.
    csp = next(a["content"] for t, a in page.tags if a.get("http-equiv") ==
               "Content-Security-Policy")
    assert "default-src 'none'" in csp and "unsafe-inline" not in csp.split("style-src")[0]


def test_hostile_strings_appear_only_escaped(tmp_path):
    text, page = exported(tmp_path)
    low = text.replace(page.scripts["nbw-plotly"], "").lower()  # plotly.js: our own code
    for bad in ("<script>window.__xss", "<img"):
        assert bad not in low, bad
    assert text.count("<script") == 3  # ours: the state, plotly.js, the app
    assert "<title>run &lt;script&gt;" in text
    # ... yet every one of them is in the state, intact, for the page to show as text.
    state = state_of(page)
    assert state["panels"]["header"]["name"] == f"run {SCRIPT}"
    assert [f"key {IMG}", f"value {SCRIPT}"] in state["report"]["config"]
    assert ["nested.note", IMG] in state["report"]["config"]
    assert any(SCRIPT in it["text"] and IMG in it["text"]
               for it in state["panels"]["samples"]["items"])
    assert any(r[3] == f"loss spike {SCRIPT}" for r in state["report"]["events"]["rows"])
    assert f"evil{IMG}" in state["panels"]["grads"]["layers"]
    assert SCRIPT in state["panels"]["attention"]["samples"][0]["tokens"]


def test_script_json_escapes_what_could_end_a_script():
    s = script_json({"a": "</script><!-- & \u2028\u2029 >"})
    assert not set(s) & {"<", ">", "&", "\u2028", "\u2029"}
    assert json.loads(s) == {"a": "</script><!-- & \u2028\u2029 >"}


def test_every_panel_and_the_report_are_in_the_state(tmp_path):
    _, page = exported(tmp_path)
    state = state_of(page)
    panels = state["panels"]
    for name in ("header", "loss", "grads", "weights", "attention", "system", "data",
                 "alerts", "samples"):
        assert panels.get(name), name
    rep = state["report"]
    summary = dict(rep["summary"])
    assert summary["state"] == "finished" and summary["steps"] == "200 / 200"
    best = RunReader(tmp_path / "run").df()["loss/val"]
    assert summary["best val loss"] == f"{best.min():.4f} at step {int(best.idxmin())}"
    assert summary["tokens seen"] == "20,000"
    assert summary["wall time"] == "20s"
    ck = rep["checkpoints"]
    assert ck["total"] == 4 and ck["rows"][0][:5] == [200, "step_00000200.pt", "1.0 MiB",
                                                      "0.05", "best"]
    assert {r[1] for r in rep["events"]["rows"]} == {"alert", "action"}
    assert ["python", "3.11"] in rep["environment"]
    # Numeric arrays travel as base64 buffers that decode to what the panels hold.
    train = panels["loss"]["train"]
    ys = np.frombuffer(base64.b64decode(state["buffers"][train["y"]["$buf"]]), np.float32)
    assert len(ys) == 200 and ys[0] > ys[-1]


def test_size_is_bounded_whatever_the_run_length(tmp_path):
    small = snapshot(RunReader(write_run(tmp_path / "a", steps=300)), max_points=100,
                     max_columns=12)
    big = snapshot(RunReader(write_run(tmp_path / "b", steps=6000, hist_every=10)),
                   max_points=100, max_columns=12)
    for snap in (small, big):
        for t in ("train", "smooth", "lr"):
            assert len(snap["panels"]["loss"][t]["x"]) <= 100
        assert len(snap["panels"]["grads"]["grad_norm/global"]["x"]) <= 100
        hist = snap["panels"]["weights"]["hist"]
        assert sum(len(h["steps"]) for h in hist.values()) <= 3 * 16  # ≥ 16 a layer
    big_hist = big["panels"]["weights"]["hist"]["blocks.0.attn"]
    assert big_hist["steps"][-1] == 6000  # the newest column is kept
    # min and max survive the downsampling: a spike is not averaged away.
    reader = RunReader(tmp_path / "b")
    full = reader.df()["loss/train"]
    ys = big["panels"]["loss"]["train"]["y"]
    assert ys.max() == np.float32(full.max()) and ys.min() == np.float32(full.min())


def test_monitor_run_and_cli_export(tiny, tmp_path, capsys):
    model, opt, batches = tiny
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "m", config={"note": SCRIPT},
                          name=f"tiny {IMG}")
    mon.start(tiny_step, batches, max_steps=20, val_fn=lambda m: 1.0, eval_every=10,
              sample_fn=lambda m: f"said {SCRIPT}", probe_batch=batches[0], display=False)
    mon.wait()
    a = mon.export_html(tmp_path / "a.html")
    b = nbwatch.open_run(tmp_path / "m").export_html(tmp_path / "b.html")
    c = nbwatch.export_html(tmp_path / "m", tmp_path / "c.html")
    assert main(["export", str(tmp_path / "m"), "-o", str(tmp_path / "d.html")]) == 0
    assert "d.html" in capsys.readouterr().out
    for path in (a, b, c, tmp_path / "d.html"):
        page = Page(path.read_text(encoding="utf-8"))
        state = state_of(page)
        assert state["panels"]["header"]["step"] == 20
        assert state["panels"]["header"]["name"] == f"tiny {IMG}"
        assert state["panels"]["samples"]["items"][0]["text"] == f"said {SCRIPT}"
        assert "<img" not in path.read_text(encoding="utf-8").split("nbw-plotly")[0].lower()
    assert main(["export", str(tmp_path / "nothing")]) == 1


def test_demo_ends_with_its_snapshot(tmp_path, capsys):
    run = tmp_path / "demo"
    assert main(["demo", "--steps", "4", "--eval-every", "2", "--run-dir", str(run),
                 "--print-every", "0.5"]) == 0
    out = capsys.readouterr().out
    assert f"snapshot: {run / 'report.html'}" in out
    state = state_of(Page((run / "report.html").read_text(encoding="utf-8")))
    assert state["panels"]["header"]["state"] == "finished"


def test_the_summary_wall_time_is_the_header_elapsed(tmp_path):
    """One duration: the export's summary ("wall time") and the header ("elapsed") agree."""
    reader = RunReader(write_run(tmp_path / "run", steps=40))
    try:
        state = snapshot(reader)
    finally:
        reader.close()
    header = state["panels"]["header"]
    assert header["elapsed_s"] == pytest.approx(4.0, abs=0.01)  # 40 steps 0.1 s apart
    assert dict(state["report"]["summary"])["wall time"] == header["elapsed"] == "4.0s"


def test_a_baseline_run_is_drawn_in_the_export_with_its_config_difference(tiny, tmp_path):
    """`Monitor(baseline=...)` names an earlier run; the export of the new run carries the
    baseline's train/val loss and LR and what differs in its config."""
    base = write_run(tmp_path / "runs" / "exp0", steps=60)  # its config: lr 3e-4
    with pytest.raises(ValueError, match="holds no nbwatch run"):
        nbwatch.Monitor(*tiny[:2], run_dir=tmp_path / "runs" / "x", baseline=tmp_path / "no")
    model, opt, batches = tiny
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "runs" / "exp1",
                          config={"lr": 1e-3}, baseline=str(base))
    mon.start(tiny_step, batches, max_steps=10, display=False).wait()
    assert nbwatch.open_run(mon.run_dir).meta["baselines"] == [str(base.absolute())]
    state = state_of(Page(mon.export_html(tmp_path / "exp1.html").read_text(encoding="utf-8")))
    (b,) = state["panels"]["loss"]["baselines"]
    assert b["name"] == f"run {SCRIPT}" and b["step"] == 60
    assert {"train", "val", "lr", "wall", "tokens"} <= set(b)
    assert ["lr", "0.0003", "0.001"] in b["diff"]
    private = export_html(mon.run_dir, tmp_path / "private.html", environment=False)
    text = private.read_text(encoding="utf-8")
    assert str(tmp_path) not in text  # the baseline's folder named, not where it lies
    (b,) = state_of(Page(text))["panels"]["loss"]["baselines"]
    assert b["path"] == "exp0" and b["step"] == 60
    with open(base / "nbwatch.db", "r+b") as f:  # the baseline damaged since
        f.write(b"\0" * 4096)
    state = state_of(Page(mon.export_html(tmp_path / "exp1.html").read_text(encoding="utf-8")))
    assert state["panels"]["loss"].get("baselines") in (None, [])  # left out; the run drawn
    assert state["panels"]["header"]["step"] == 10


def test_no_environment_leaves_out_where_a_failed_run_ran(tiny, tmp_path):
    """`environment=False` (`nbwatch export --no-environment`) left the script's path in the
    failure's traceback: its file paths are cut to file names, the run folder to its name."""
    model, opt, batches = tiny

    def broken(m, b):
        if broken.calls == 3:
            raise RuntimeError("a collate bug")
        broken.calls += 1
        return tiny_step(m, b)

    broken.calls = 0
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "deep" / "where" / "r")
    mon.start(broken, batches, max_steps=10, display=False)
    with pytest.raises(RuntimeError, match="a collate bug"):
        mon.wait()
    here = str(Path(__file__).parent)
    text = export_html(mon.run_dir, tmp_path / "x.html").read_text(encoding="utf-8")
    assert here in text  # the traceback, with its paths, by default
    text = export_html(mon.run_dir, tmp_path / "y.html", environment=False).read_text(
        encoding="utf-8")
    assert here not in text and str(tmp_path) not in text
    assert "a collate bug" in text and "test_export.py" in text
