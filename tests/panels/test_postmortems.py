"""The loss panel carries each loss spike's post-mortem (made by the kernel, once the
store holds the spike's step), and flags the spike's marker: what a click shows."""

from __future__ import annotations

import numpy as np

from nbwatch.panels import Feed
from nbwatch.records import Event, Scalars
from nbwatch.store import RunReader, RunStore

SPIKE, ROSE = 155, 150  # a layer's gradient norm rose 5 steps before the loss spiked


def _steps(store: RunStore, first: int, last: int, rng: np.random.Generator) -> None:
    for s in range(first, last + 1):
        up = s >= ROSE
        store.put(Scalars(s, {
            "loss/train": 2.0 + 0.01 * rng.standard_normal() + (3.0 if s == SPIKE else 0.0),
            "lr": 1e-3, "grad_norm/global": 1.0 + 0.05 * rng.random() + (4.0 if s == SPIKE else 0),
            "grad_norm/blocks.0.attn": 0.5 + 0.02 * rng.random(),
            "grad_norm/blocks.1.mlp": (5.0 if up else 0.5) + 0.02 * rng.random()}))
    store.flush()


def test_a_spike_marker_carries_its_post_mortem_once_its_step_is_read(tmp_path):
    rng = np.random.default_rng(0)
    store = RunStore(tmp_path / "run")
    store.set_meta("state", "running")
    _steps(store, 1, SPIKE - 1, rng)
    # the alert reaches the store before its step's scalars: no post-mortem yet
    store.put(Event(SPIKE, "alert", "warning", "loss spike", {
        "rule": "loss_spike", "loss": 5.0, "median": 2.0, "z": 30.0,
        "batches": [{"step": SPIKE, "index": SPIKE - 1}]}))
    store.put(Event(SPIKE, "action", "info", "clip set to 1.0", {"command": "clip"}))
    store.flush()
    feed = Feed(RunReader(tmp_path / "run"))
    first = feed.update()
    markers = first["loss"]["markers"]
    assert [m.get("spike", False) for m in markers] == [True, False]
    assert "postmortems" not in first["loss"]
    _steps(store, SPIKE, SPIKE + 5, rng)
    upd = feed.update()
    pm = upd["loss"]["postmortems"][str(SPIKE)]
    assert pm["first"] == ["grad_norm/blocks.1.mlp"] and pm["lead"] == SPIKE - ROSE
    text = "\n".join(pm["lines"])
    assert text.startswith(f"loss spike at step {SPIKE}: grad_norm/blocks.1.mlp moved first, "
                           f"{SPIKE - ROSE} steps before")
    assert "grad norm of blocks.1.mlp" in text and "LOSS SPIKE" in text
    # made once: the next refresh does not send it again; a late view's full state has it
    _steps(store, SPIKE + 6, SPIKE + 8, rng)
    assert "postmortems" not in (feed.update() or {}).get("loss", {})
    assert feed.full()["loss"]["postmortems"] == {str(SPIKE): pm}
    store.close()
