import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from nbwatch.panels.tail import Tail
from nbwatch.records import Attention, Command, Event, Histogram, Sample, Scalars
from nbwatch.store import RunReader, RunStore


@pytest.fixture
def store(tmp_path):
    s = RunStore(tmp_path / "run")
    yield s
    s.close()


def test_records_round_trip(store):
    store.put(Scalars(1, {"loss/train": 2.5, "lr": 1e-3}))
    store.put(Scalars(2, {"loss/train": 2.0, "lr": 1e-3, "loss/val": 2.2}))
    store.put(Histogram(2, "weight/head", np.linspace(-1, 1, 5), np.array([1, 2, 3, 4])))
    w = np.random.rand(2, 3, 3).astype(np.float32)
    store.put(Attention(2, "blocks.0.attn", 0, w, ("a", "b", "c")))
    store.put(Event(2, "action", "info", "paused at step 2", {"command": "pause"}))
    store.put(Sample(2, "def f(): <b>x</b>"))
    store.set_meta("config", {"lr": 1e-3, "name": "x"})
    store.flush()
    r = RunReader(store.run_dir)
    df = r.df()
    assert list(df.index) == [1, 2]
    assert df.loc[2, "loss/val"] == 2.2 and np.isnan(df.loc[1, "loss/val"])
    steps, edges, counts = r.histograms("weight/head")
    assert steps.tolist() == [2] and counts[0].tolist() == [1, 2, 3, 4]
    np.testing.assert_array_equal(edges[0], np.linspace(-1, 1, 5))
    att = r.attention()
    np.testing.assert_allclose(att["blocks.0.attn"], w, atol=1e-3)  # stored as float16
    assert r.attention_tokens(2) == ["a", "b", "c"]
    ev = r.events()
    assert ev.iloc[0]["message"] == "paused at step 2" and ev.iloc[0]["data"]["command"] == "pause"
    assert r.samples().text.iloc[0] == "def f(): <b>x</b>"
    assert r.meta()["config"] == {"lr": 1e-3, "name": "x"}
    with pytest.raises(KeyError, match="no histogram series 'weight/nope'.*weight/head"):
        r.histograms("weight/nope")
    r.close()


def test_rewriting_a_step_replaces_its_value_and_tail_sees_it(store):
    store.put(Scalars(1, {"a": 1.0}))
    store.flush()
    r = RunReader(store.run_dir)
    tail = Tail(r)
    assert tail.poll().scalars["a"][1].tolist() == [1.0]
    store.put(Scalars(1, {"a": 5.0}))
    store.flush()
    steps, values = tail.poll().scalars["a"]
    assert steps.tolist() == [1] and values.tolist() == [5.0]
    assert r.df().loc[1, "a"] == 5.0


def test_truncate_after_drops_later_steps(store):
    for s in range(1, 6):
        store.put(Scalars(s, {"a": float(s)}))
    store.truncate_after(3)
    store.flush()
    assert RunReader(store.run_dir).df().index.tolist() == [1, 2, 3]


def test_commands_from_another_writer_are_seen_once(store):
    store.add_command(Command("pause", None, "attach"))
    store.flush()
    pending = store.pending_commands()
    assert [c.kind for _, c in pending] == ["pause"]
    store.mark_taken(pending[0][0])
    store.flush()
    assert store.pending_commands() == []


def test_commits_within_the_flush_interval_without_flush(store):
    store.put(Scalars(1, {"a": 1.0}))
    time.sleep(store.flush_interval * 3)
    assert RunReader(store.run_dir).last_step() == 1


def test_second_process_reads_while_first_writes(tmp_path):
    run = tmp_path / "run"
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from nbwatch.records import Scalars
            from nbwatch.store import RunStore
            s = RunStore({str(run)!r})
            for step in range(1, 400):
                s.put(Scalars(step, {{"loss/train": 1.0 / step}}))
                time.sleep(0.005)
            s.close()
        """)],
    )
    try:
        deadline = time.monotonic() + 30
        while not (run / "nbwatch.db").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        reader = RunReader(run)
        seen = []
        while writer.poll() is None and time.monotonic() < deadline:
            seen.append(reader.last_step())
            time.sleep(0.1)
        assert writer.wait(30) == 0
        growing = [s for s in seen if 0 < s < 399]
        assert len(set(growing)) >= 3, f"reader saw no progress while writing: {seen}"
        assert seen == sorted(seen)
        assert reader.last_step() == 399
        assert reader.df()["loss/train"].iloc[-1] == pytest.approx(1 / 399)
        reader.close()
    finally:
        writer.kill()


def test_reader_on_a_folder_without_a_run_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no nbwatch run"):
        RunReader(tmp_path)


def test_a_command_is_not_handed_out_twice_before_taken_commits(store):
    store.add_command(Command("scale_lr", 0.5, "attach"))
    store.flush()
    (cid, cmd), = store.pending_commands()
    store.mark_taken(cid)  # queued, not committed yet
    assert store.pending_commands(after_id=cid) == []
