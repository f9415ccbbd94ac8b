"""The ranks panel's builder: per-rank medians over the recent window, the slowest rank,
the straggler message, per-rank lines; nothing for a run of one rank."""

import numpy as np
import pytest

from nbwatch.panels import ranks


def s(steps, values):
    return np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float32)


def rank_series(r: int, steps: np.ndarray, forward: float, data: float = 0.001,
                step: float = 0.05, tokens: float = 1000.0) -> dict:
    n = len(steps)
    sync = np.where(steps % 5 == 0, 0.004, 0.0)  # the exchange runs every 5 steps
    return {f"rank{r}/loss": s(steps, np.linspace(4, 3, n)),
            f"rank{r}/time/step": s(steps, np.full(n, step)),
            f"rank{r}/time/data": s(steps, np.full(n, data)),
            f"rank{r}/time/forward": s(steps, np.full(n, forward)),
            f"rank{r}/throughput/tokens_per_s": s(steps, np.full(n, tokens)),
            f"rank{r}/time/sync": s(steps, sync)}


STRAGGLER = {"step": 20, "kind": "alert", "severity": "warning",
             "message": "straggler: rank 2 is 90% slower than the others (median time ...)"}


def test_medians_per_rank_and_the_slowest():
    steps = np.arange(1, 61)
    series = {**rank_series(0, steps, forward=0.010, tokens=2000),
              **rank_series(1, steps, forward=0.011, tokens=1900),
              **rank_series(2, steps, forward=0.020, tokens=1000)}
    # An outlier step on rank 0 does not move its median.
    series["rank0/time/forward"][1][30] = 5.0
    recent = {k: (st[-ranks.WINDOW:], v[-ranks.WINDOW:]) for k, (st, v) in series.items()}
    d = ranks.build(series, recent, [STRAGGLER])
    assert d["ranks"] == [0, 1, 2] and d["window"] == 50 and d["to_step"] == 60
    np.testing.assert_allclose(d["busy_s"], [0.011, 0.012, 0.021], rtol=1e-5)
    np.testing.assert_allclose(d["step_s"], [0.05] * 3, rtol=1e-6)
    np.testing.assert_allclose(d["tokens_per_s"], [2000, 1900, 1000])
    np.testing.assert_allclose(d["sync_s"], [0.0008] * 3, rtol=1e-5)  # mean: cost per step
    assert "mem_gb" not in d  # not recorded on CPU
    assert d["slowest"] == 2
    assert d["slower_by"] == pytest.approx(0.021 / 0.0115 - 1, rel=1e-4)
    assert d["straggler"] == {"step": 20, "message": STRAGGLER["message"]}
    assert sorted(d["loss"]) == ["0", "1", "2"] and d["loss"]["2"]["y"].dtype == np.float32
    # The exchange lines hold only the steps where it ran.
    assert list(d["sync"]["1"]["x"]) == list(range(5, 61, 5))


def test_window_keeps_the_newest_points():
    old = None
    for start in range(0, 120, 7):
        st = np.arange(start, start + 7)
        old = ranks.keep_recent(old, st, st.astype(np.float32))
    assert len(old[0]) == ranks.WINDOW and old[0][-1] == 125 and old[0][0] == 76


def test_without_forward_the_step_time_picks_the_slowest():
    steps = np.arange(10)
    recent = {"rank0/time/step": s(steps, np.full(10, 0.3)),
              "rank1/time/step": s(steps, np.full(10, 0.1))}
    d = ranks.bars(recent)
    assert d["busy_s"] == [None, None] and d["slowest"] == 0
    assert d["slower_by"] == pytest.approx(2.0)


def test_hidden_for_a_single_rank_and_bars_not_resent_without_new_rank_figures():
    steps = np.arange(1, 20)
    one = rank_series(0, steps, forward=0.01)
    assert ranks.build({**one, "loss/train": s(steps, np.ones(19))}, one, []) == {}
    two = {**one, **rank_series(1, steps, forward=0.02)}
    d = ranks.build({"loss/train": s([20], [1.0])}, None, [])
    assert d == {}
    d = ranks.build(two, None, [])
    assert "ranks" not in d and sorted(d["loss"]) == ["0", "1"]


def test_feed_sends_bars_with_new_rank_figures_only(tmp_path):
    """The live path: Feed folds a store's `rank{r}/...` columns into the ranks panel; a
    refresh that brought no rank figures does not resend the bars; `full()` holds them."""
    from nbwatch.panels import Feed
    from nbwatch.records import Event, Scalars
    from nbwatch.store import RunReader, RunStore

    store = RunStore(tmp_path / "run")
    reader = RunReader(tmp_path / "run")
    try:
        for step in range(1, 81):
            store.put(Scalars(step, {"loss/train": 3.0, "rank0/loss": 3.1, "rank1/loss": 2.9,
                                     "rank0/time/forward": 0.01, "rank1/time/forward": 0.03,
                                     "rank0/time/step": 0.05, "rank1/time/step": 0.05}))
        store.put(Event(40, "alert", "warning", "straggler: rank 1 is 200% slower ..."))
        store.flush()
        feed = Feed(reader)
        d = feed.update()["ranks"]
        assert d["ranks"] == [0, 1] and d["slowest"] == 1 and d["window"] == ranks.WINDOW
        assert d["busy_s"] == pytest.approx([0.01, 0.03])
        assert d["straggler"]["step"] == 40 and len(d["loss"]["1"]["x"]) == 80
        store.put(Scalars(81, {"loss/train": 3.0}))
        store.flush()
        assert "ranks" not in (feed.update() or {})
        full = feed.full()["ranks"]
        assert full["slowest"] == 1 and full["to_step"] == 80
        assert full["straggler"]["message"].startswith("straggler: rank 1")
    finally:
        reader.close()
        store.close()
