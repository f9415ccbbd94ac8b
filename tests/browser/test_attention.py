"""The attention panel in JupyterLab: until the first eval one line says at which step its
maps come; an eval's message carries the per-head overview and no map; opening a head asks
the kernel for that one map, and the page draws what the store holds. A later eval
re-fetches the head left open. The run folder is written here, by this process (a writer
another process follows), and shown by `Dashboard.for_run` in a kernel."""

from __future__ import annotations

import time

import nbformat
import numpy as np
import pytest

from nbwatch.records import Attention, Scalars
from nbwatch.store import RunReader, RunStore

from .harness import click_head, open_notebook, run_all

pytestmark = pytest.mark.browser

MODULES = [f"blocks.{i}.attn" for i in range(3)]
HEADS, T = 4, 6
KERNEL = "window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"

# Every comm message on the wire, as the page's kernel connection sees it: the kernel's
# refreshes (type, map keys in them, buffer bytes) and the page's attention fetches.
RECORD = """() => {
  window.__wire = [];
  const k = """ + KERNEL + """;
  k.anyMessage.connect((_, a) => {
    const m = a.msg;
    if (m.header.msg_type !== 'comm_msg') return;
    const d = (m.content.data || {}).content || {}; // a widget's custom message
    const bytes = (m.buffers || []).reduce((n, b) => n + (b.byteLength || 0), 0);
    window.__wire.push({dir: a.direction, type: d.type, bytes,
                        maps: JSON.stringify(d).includes('"maps"'),
                        ask: d.type === 'attention' && a.direction === 'send'
                          ? [d.step, d.sample, d.layer, d.head] : null});
  });
}"""


def _eval(store: RunStore, step: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    store.put(Scalars(step, {"loss/val": 2.0}))
    for m in MODULES:
        a = rng.random((HEADS, T, T)).astype(np.float32) + 0.05
        store.put(Attention(step, m, 0, a / a.sum(-1, keepdims=True), tuple("abcdef")))
    store.flush()


def _drawn(page) -> dict:
    return page.evaluate("""() => {
        const box = document.querySelector('[data-panel=attention]');
        const gd = box.querySelector('.nbw-attn-map');
        return {open: box.dataset.open, step: box.dataset.mapStep,
                title: gd._fullLayout ? gd._fullLayout.title.text : null,
                z: gd.data ? gd.data[0].z : null};
    }""")


def _wait_open(page, head: str, step: int) -> dict:
    page.wait_for_function(
        """([o, s]) => { const b = document.querySelector('[data-panel=attention]');
            return b && b.dataset.open === o && b.dataset.mapStep === String(s); }""",
        arg=[head, step], timeout=30_000)
    return _drawn(page)


_HEIGHT = "() => document.querySelector('[data-panel=attention]').getBoundingClientRect().height"
# the panel's note is shown and reads `text` (any text where "")
_SAYS = """(text) => { const e = document.querySelector('[data-panel=attention] .nbw-empty');
    return !!e?.offsetParent && (!text || e.textContent === text); }"""


def test_opening_a_head_fetches_its_map_from_the_kernel(page, lab, workdir):
    run_dir = workdir / "runs" / "attn_fetch"
    store = RunStore(run_dir)
    try:
        store.set_meta("state", "running")
        store.set_meta("run", {"eval_every": 10, "options": {"attention_samples": 2}})
        for s in range(1, 6):
            store.put(Scalars(s, {"loss/train": 3.0 - s / 10}, wall=time.time()))
        store.flush()
        nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
            "name": "python3", "display_name": "Python 3", "language": "python"}})
        nb.cells = [nbformat.v4.new_code_cell(
            "from nbwatch.widget import Dashboard\n"
            "dash = Dashboard.for_run('runs/attn_fetch')\ndash")]
        nbformat.write(nb, workdir / "attn_fetch.ipynb")
        open_notebook(page, f"{lab.url}/lab/tree/attn_fetch.ipynb?reset")
        page.evaluate(RECORD)
        run_all(page)
        # before the first eval: the panel is one line saying when maps come (it was a blank
        # box ~840 px tall under "no probe yet"); they come, and it grows into them
        page.wait_for_function(_SAYS, arg="no attention maps yet: they come with the first "
                               "eval, at step 10", timeout=30_000)
        assert page.evaluate(_HEIGHT) < 80
        for s in range(6, 11):
            store.put(Scalars(s, {"loss/train": 3.0 - s / 10}, wall=time.time()))
        _eval(store, 10, seed=0)
        # the overview is drawn, and the head open by default (0:0) fetched
        first = _wait_open(page, "0:0", 10)
        assert page.evaluate(_HEIGHT) > 500 and not page.evaluate(_SAYS, arg="")
        ov = page.evaluate("""() => { const t = document.querySelector(
            '[data-panel=attention] .nbw-attn-overview').data[0];
            return [t.z.length, t.z[0].length]; }""")
        assert ov == [len(MODULES), HEADS]
        reader = RunReader(run_dir)
        want = reader.attention(10)
        np.testing.assert_array_equal(np.array(first["z"], dtype=np.float64),
                                      want[MODULES[0]][0].astype(np.float64))
        wire = page.evaluate("() => window.__wire")
        refreshes = [w for w in wire if w["dir"] == "recv" and w["type"] in ("full", "delta")]
        assert refreshes and not any(w["maps"] for w in refreshes), refreshes
        # one map would be 3 × 4 × 36 B as uint8: the refreshes' buffers are the numbers
        assert [w["ask"] for w in wire if w["ask"]] == [[10, 0, 0, 0]]

        click_head(page, 2, 3)
        got = _wait_open(page, "2:3", 10)
        assert got["title"] == f"{MODULES[2]}, head 3"
        z = np.array(got["z"], dtype=np.float64)
        assert z.shape == (T, T)
        np.testing.assert_array_equal(z, want[MODULES[2]][3].astype(np.float64))
        wire = page.evaluate("() => window.__wire")
        assert [w["ask"] for w in wire if w["ask"]][-1] == [10, 0, 2, 3]
        reply = [w for w in wire if w["dir"] == "recv" and w["type"] == "attention"][-1]
        assert reply["bytes"] == T * T * 4  # one head's float32 map, nothing else

        # A new eval: its overview comes without maps, and the head left open is fetched anew.
        _eval(store, 20, seed=1)
        got = _wait_open(page, "2:3", 20)
        np.testing.assert_array_equal(np.array(got["z"], dtype=np.float64),
                                      reader.attention(20)[MODULES[2]][3].astype(np.float64))
        wire = page.evaluate("() => window.__wire")
        assert not any(w["maps"] for w in wire if w["type"] in ("full", "delta"))
        assert [w["ask"] for w in wire if w["ask"]][-1] == [20, 0, 2, 3]
    finally:
        store.set_meta("state", "finished")
        store.close()
        lab.shutdown_kernels()
