"""Every legend of the dashboard stays off the data and off its figure's title, in
JupyterLab: the Health panel's output logits (its legend sat inside the plot at the top
left, over the run's first steps), the per-rank loss and exchange time of a job of many
ranks, the system figures of a machine of many GPUs, the global grad norm, the loss."""

from __future__ import annotations

import time

import numpy as np
import pytest

from nbwatch.records import Scalars, SystemSample
from nbwatch.store import RunStore

from .harness import dashboard_notebook, open_notebook, run_all

pytestmark = pytest.mark.browser

RANKS, GPUS = 8, 8
# the figures that show a legend, by a CSS selector of their plotly div
LEGENDS = ("[data-panel=health] .nbw-health-out", "[data-panel=ranks] .nbw-ranks-loss",
           "[data-panel=ranks] .nbw-ranks-sync", "[data-panel=system] .nbw-system-util",
           "[data-panel=system] .nbw-system-mem", "[data-panel=grads] .nbw-grads-norm",
           "[data-panel=loss] .js-plotly-plot")


def _run(run_dir) -> None:
    """A finished run with every figure that has a legend: output logits (probe and every
    training batch), a job of RANKS ranks, a machine of GPUS GPUs."""
    store = RunStore(run_dir)
    t0 = time.time() - 100
    for s in range(1, 101):
        up = 1.0 + s / 50
        v = {"loss/train": 3.0 * np.exp(-s / 200), "lr": 1e-3, "grad_norm/global": up,
             "grad_norm/clipped": min(up, 1.5), "train_logits/log_z": 2.0 * up,
             "train_logits/max_abs": 10.0 * up}
        if s % 10 == 0:
            v.update({"loss/val": 3.1 * np.exp(-s / 200), "logits/z_mean": 2.0 * up + 0.05,
                      "logits/max_abs": 10.0 * up + 0.5})
        for r in range(RANKS):
            v.update({f"rank{r}/loss": v["loss/train"] + 0.01 * r, f"rank{r}/time/sync": 1e-3,
                      f"rank{r}/time/step": 0.1, f"rank{r}/time/busy": 0.05 + 0.001 * r})
        store.put(Scalars(s, v, wall=t0 + s))
        store.put(SystemSample({"system/cpu/util": 50.0, "system/ram/used_gb": 2.0,
                                **{f"system/gpu{g}/{k}": 30.0 + g for g in range(GPUS)
                                   for k in ("util", "mem_used_gb")}}, step=s, wall=t0 + s))
    store.set_meta("state", "finished")
    store.set_meta("step", 100)
    store.close()


def _boxes(page, sel: str) -> dict[str, list[float] | None]:
    """Page boxes [left, top, right, bottom] of the figure, its legend, its plot area (the
    drag rectangle of its x-y subplot) and its title."""
    return page.evaluate("""(sel) => { const gd = document.querySelector(sel);
        const box = (e) => { if (!e) return null; const r = e.getBoundingClientRect();
          return [r.left, r.top, r.right, r.bottom]; };
        return {div: box(gd), legend: box(gd.querySelector('.legend')),
                plot: box(gd.querySelector('.draglayer .xy .nsewdrag')),
                title: box(gd.querySelector('.g-gtitle .gtitle'))}; }""", sel)


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5


def test_legends_stay_off_the_data_and_the_titles(page, lab, workdir):
    _run(workdir / "runs" / "legends")
    dashboard_notebook(workdir, "legends")
    try:
        open_notebook(page, f"{lab.url}/lab/tree/legends.ipynb?reset")
        run_all(page)
        for sel in LEGENDS:
            page.wait_for_function("(sel) => document.querySelector(sel)?.querySelector("
                                   "'.legend .traces')", arg=sel, timeout=30_000)
        page.wait_for_timeout(500)  # a margin pushed by a legend: plotly's second draw
        bad = []
        for sel in LEGENDS:
            b = _boxes(page, sel)
            legend, plot, div = b["legend"], b["plot"], b["div"]
            if not (legend[2] - legend[0] > 20 and legend[3] - legend[1] > 5):
                bad.append(f"{sel}: no legend drawn {b}")
            if not (div[0] - 0.5 <= legend[0] and legend[2] <= div[2] + 0.5
                    and div[1] - 0.5 <= legend[1] and legend[3] <= div[3] + 0.5):
                bad.append(f"{sel}: the legend outside its figure {b}")
            if not (plot[2] - plot[0] > 100 and plot[3] - plot[1] > 60):
                bad.append(f"{sel}: a plot area too small {b}")
            if _overlap(legend, plot):
                bad.append(f"{sel}: the legend over the data {b}")
            if b["title"] is not None and _overlap(legend, b["title"]):
                bad.append(f"{sel}: the legend over the title {b}")
        assert not bad, "\n".join(bad)
    finally:
        lab.shutdown_kernels()
