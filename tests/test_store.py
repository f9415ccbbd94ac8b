import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.panels.tail import Tail
from nbwatch.records import Attention, Command, Event, Histogram, Sample, Scalars
from nbwatch.store import SCHEMA_VERSION, RunReader, RunStore, blocks
from tests.conftest import until


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
    sent = Command("rewind", {"steps": 10, "skip": 0}, "attach")
    store.add_command(sent)
    store.flush()
    pending = store.pending_commands()
    assert [c for _, _, c in pending] == [sent]  # kind, payload, source and id come back
    store.mark_taken(pending[0][0])
    store.flush()
    assert store.pending_commands() == []


def test_commits_within_the_flush_interval_without_flush(store):
    store.put(Scalars(1, {"a": 1.0}))
    until(lambda: RunReader(store.run_dir).last_step() == 1, store.flush_interval * 3,
          "a commit without flush()")


def readable(run: Path) -> bool:
    """The run's store exists and its writer has created the tables."""
    try:
        RunReader(run).last_step()
    except (FileNotFoundError, sqlite3.OperationalError):
        return False
    return True


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
        until(lambda: readable(run), 30, "the writer to create its store")
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
    store.add_command(Command("scale_lr", {"factor": 0.5}, "attach"))
    store.flush()
    (cid, _, cmd), = store.pending_commands()
    store.mark_taken(cid)  # queued, not committed yet
    assert store.pending_commands(after_id=cid) == []


def test_precision_follows_the_family(store):
    """Loss, LR and a user's own scalars keep float64; norms and timings are float32."""
    loss, lr, acc, norm = 2.718281828459045, 3.0000001e-4, 0.123456789012, 1.2345678901
    store.put(Scalars(1, {"loss/train": loss, "lr/group0": lr, "accuracy": acc,
                          "grad_norm/global": norm}))
    store.flush()
    row = RunReader(store.run_dir).df().loc[1]
    assert row["loss/train"] == loss and row["lr/group0"] == lr and row["accuracy"] == acc
    assert row["grad_norm/global"] == np.float32(norm) and row["grad_norm/global"] != norm


def test_partial_read_returns_the_window_and_keys_asked(store):
    for s in range(1, 1001):
        store.put(Scalars(s, {"loss/train": float(s), "grad_norm/global": s / 10}))
        if s % 100 == 0:
            store.put(Scalars(s, {"loss/val": s + 0.5}))
    store.flush()
    r = RunReader(store.run_dir)
    win = r.scalars(["loss/train", "loss/val"], start=450, stop=700)
    assert win.index.tolist() == list(range(450, 700))
    assert list(win.columns) == ["loss/train", "loss/val"]
    assert win["loss/val"].dropna().to_dict() == {500: 500.5, 600: 600.5}
    assert (win["loss/train"] == win.index).all()
    assert r.best("loss/val") == (100, 100.5) and r.last_value("loss/train") == 1000.0


def test_a_key_recorded_in_two_layouts_reads_in_step_order(store):
    """The first step often has keys the others lack: the same key then sits in two
    layouts, interleaved within one commit."""
    for s in range(1, 21):
        values = {"loss/train": float(s)}
        if s % 5 == 0:
            values["loss/val"] = -float(s)
        store.put(Scalars(s, values))
    store.flush()
    r = RunReader(store.run_dir)
    assert r.df()["loss/train"].tolist() == [float(s) for s in range(1, 21)]
    steps, values = Tail(r).poll().scalars["loss/train"]
    assert steps.tolist() == list(range(1, 21)) and values.tolist() == steps.tolist()


def test_truncate_cuts_inside_a_block_and_later_steps_are_recorded_once(store):
    for s in range(1, 101):  # one commit: one block holding steps 1..100
        store.put(Scalars(s, {"loss/train": float(s)}))
    store.truncate_after(42)
    for s in range(43, 61):
        store.put(Scalars(s, {"loss/train": -float(s)}))
    store.flush()
    r = RunReader(store.run_dir)
    df = r.df()
    assert df.index.tolist() == list(range(1, 61))
    assert df.loc[42, "loss/train"] == 42.0 and df.loc[43, "loss/train"] == -43.0
    assert r.walls().index.tolist() == list(range(1, 61)) and r.last_step() == 60


def test_put_blocks_the_producer_instead_of_growing_without_bound(tmp_path):
    store = RunStore(tmp_path / "run", max_pending=2_000)
    peak = 0
    for s in range(1, 20_001):
        store.put(Scalars(s, {f"grad_norm/l{i}": 1.0 for i in range(10)}))
        peak = max(peak, store._pending)
    store.close()
    assert peak <= 2_000  # never more than max_pending scalars queued
    assert RunReader(tmp_path / "run").df().shape == (20_000, 10)  # and nothing dropped


def test_a_closed_store_is_one_file_that_can_be_copied_alone(tmp_path):
    store = RunStore(tmp_path / "run")
    reader = RunReader(tmp_path / "run")
    for s in range(1, 301):
        store.put(Scalars(s, {"loss/train": 1.0 / s}))
        if s % 50 == 0:
            store.flush()
            assert reader.last_step() == s  # a reader in this process follows the run
    store.put(Event(300, "state", "info", "run finished", {}))
    store.close()
    left = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert left == ["nbwatch.db"]
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(tmp_path / "run" / "nbwatch.db", copy / "nbwatch.db")
    r = RunReader(copy)
    assert r.df().index.tolist() == list(range(1, 301))
    assert r.events().message.tolist() == ["run finished"]
    assert sorted(p.name for p in copy.iterdir()) == ["nbwatch.db"]  # reading adds no files


def test_a_schema_1_folder_is_migrated_in_place_with_a_warning(tmp_path):
    """tests/data/run_v1 was written by nbwatch 0.1.0 (`nbwatch demo --steps 30`)."""
    src = Path(__file__).parent / "data" / "run_v1"
    run = tmp_path / "old"
    shutil.copytree(src, run)
    con = sqlite3.connect(run / "nbwatch.db")
    old = con.execute("SELECT s.step, k.name, s.value FROM scalars s JOIN keys k"
                      " ON s.key = k.id").fetchall()
    old_walls = dict(con.execute("SELECT step, wall FROM steps"))
    old_hists = con.execute("SELECT step, name, edges, counts FROM histograms").fetchall()
    con.close()
    with pytest.warns(UserWarning, match="nbwatch 0.1.0.*migrated in place"):
        run_ = nbwatch.open_run(run)
    df = run_.df
    assert df.index.tolist() == list(range(1, 31))
    for step, key, value in old:
        got = df.loc[step, key]
        if value is None:
            assert np.isnan(got)
        elif blocks.dtype_of(blocks.family(key)) == "f8":
            assert got == value, key
        else:
            assert got == pytest.approx(value, rel=1e-6), key
    assert run_.reader.walls().to_dict() == old_walls
    assert run_.reader.meta()["schema_version"] == SCHEMA_VERSION and run_.state == "finished"
    assert len(run_.events) > 0 and old_hists
    for step, name, edges, counts in old_hists:  # now blocks: the same, exactly
        steps, e, c = run_.histograms(name)
        i = steps.tolist().index(step)
        assert np.array_equal(e[i], np.frombuffer(edges, dtype=np.float64))
        assert np.array_equal(c[i], np.frombuffer(counts, dtype=np.int64))
    out = run_.export_html(tmp_path / "old.html")
    assert out.stat().st_size > 100_000
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(nbwatch.open_run(run).df) == 30  # the new schema: no warning, no rewrite



def test_closing_merges_a_live_runs_small_blocks_and_a_follower_reads_nothing_twice(tmp_path):
    store = RunStore(tmp_path / "run")
    follower = Tail(RunReader(tmp_path / "run"))
    seen: dict[str, list[int]] = {}

    def follow() -> None:
        for key, (steps, _) in follower.poll().scalars.items():
            seen.setdefault(key, []).extend(steps.tolist())

    for s in range(1, 501):
        store.put(Scalars(s, {"loss/train": float(s), "grad_norm/a": s / 2, "grad_norm/b": 1.0}))
        if s % 5 == 0:  # a commit every 5 steps: 100 small blocks per layout
            store.flush()
            if s <= 400:  # the follower falls behind before the end
                follow()
    r = RunReader(tmp_path / "run")
    assert len(r.query("SELECT id FROM blocks")) == 200
    store.close()
    assert len(r.query("SELECT id FROM blocks")) == 2  # one per layout
    assert len(r.query("SELECT id FROM walls")) == 1
    df = r.df()
    assert df.index.tolist() == list(range(1, 501))
    assert df["grad_norm/a"].tolist() == [s / 2 for s in range(1, 501)]
    assert r.walls().index.tolist() == list(range(1, 501))
    follow()  # the merged blocks straddle its cursor: it gets steps 401..500, once
    assert seen["loss/train"] == list(range(1, 501))
    assert seen["grad_norm/b"] == list(range(1, 501))
    assert follower.poll().scalars == {}


def test_a_run_folder_named_with_uri_characters_reads_back(tmp_path):
    run = tmp_path / "lr=3e-4 #2 ?x %20"
    store = RunStore(run)
    store.put(Scalars(1, {"loss/train": 1.5}))
    store.close()
    assert RunReader(run).df().loc[1, "loss/train"] == 1.5


def test_a_follower_sees_what_a_resumed_run_writes_after_its_truncate(store):
    """Row ids are never reused: a cursor past the truncated rows still reads the new ones."""
    follower = Tail(RunReader(store.run_dir))
    for s in range(1, 11):
        store.put(Scalars(s, {"loss/train": float(s)}))
        store.put(Sample(s, f"old {s}"))
    store.flush()
    first = follower.poll()
    assert first.scalars["loss/train"][0].tolist() == list(range(1, 11))
    store.truncate_after(5)  # a resume from the checkpoint of step 5
    for s in range(6, 9):
        store.put(Scalars(s, {"loss/train": -float(s)}))
        store.put(Sample(s, f"new {s}"))
    store.flush()
    d = follower.poll()
    steps, values = d.scalars["loss/train"]
    assert steps.tolist() == [6, 7, 8] and values.tolist() == [-6.0, -7.0, -8.0]
    assert [x["text"] for x in d.samples] == ["new 6", "new 7", "new 8"]


def test_a_store_from_a_newer_nbwatch_says_to_upgrade(tmp_path):
    store = RunStore(tmp_path / "run")
    store.set_meta("schema_version", 99)
    store.close()
    with pytest.raises(RuntimeError, match="written by a newer nbwatch.*upgrade"):
        nbwatch.open_run(tmp_path / "run")


def test_a_dead_writer_is_noticed_at_once_and_the_folder_unlocked(tmp_path):
    from nbwatch.store import StoreFailed, writer_alive

    store = RunStore(tmp_path / "run")
    store.put(Histogram(2, "h", np.array(["a", "b"]), np.array([1])))  # cannot be stored
    t0 = time.monotonic()
    with pytest.raises(StoreFailed):
        store.flush(timeout=30)
    assert time.monotonic() - t0 < 5  # not after the whole timeout
    store.close()  # flush() raised the error: close() stops the writer, raises it not again
    assert not writer_alive(tmp_path / "run")  # a new writer may take the folder
    again = RunStore(tmp_path / "run")
    again.put(Histogram(2, "h", np.array(["a", "b"]), np.array([1])))
    until(lambda: again.error is not None, 10, "the writer to fail")
    with pytest.raises(StoreFailed):  # nobody was told yet: close() says it
        again.close()
    assert not writer_alive(tmp_path / "run")
    RunStore(tmp_path / "run").close()


def test_a_layout_shared_by_two_records_of_one_commit_is_one_block_in_step_order(store):
    """An eval step's record has more keys than the others, but the same grad norms: those
    get one block per commit, in step order, so a follower reading "the steps after the
    last I read" never skips one when closing merges blocks."""
    for s in range(1, 21):
        v = {"grad_norm/a": float(s), "grad_norm/b": 1.0}
        if s == 10:
            v["loss/val"] = 2.0
        store.put(Scalars(s, v))
    store.flush()
    r = RunReader(store.run_dir)
    rows = r.block_rows(["grad_norm/a"])
    assert len(rows) == 1
    steps, values = blocks.decode(rows[0][2], rows[0][3], rows[0][4], r.layout(rows[0][1]))
    assert steps.tolist() == list(range(1, 21)) and values[:, 0].tolist() == steps.tolist()


def test_a_live_runs_small_blocks_are_merged_as_it_goes_and_a_follower_reads_each_once(tmp_path):
    """Merged while the run writes (every `compact_every` s), not only at close: closing a
    long live run has only its last seconds to merge."""
    store = RunStore(tmp_path / "run")
    store.compact_every = 0.0  # at every commit here; 30 s in a run
    follower = Tail(RunReader(tmp_path / "run"))
    seen: list[int] = []
    r = RunReader(tmp_path / "run")

    def follow() -> list[int]:
        got = follower.poll().scalars.get("loss/train")
        return got[0].tolist() if got is not None else []

    for s in range(1, 301):
        store.put(Scalars(s, {"loss/train": float(s), "grad_norm/a": s / 2}))
        if s % 5 == 0:  # a commit every 5 steps
            store.flush()
            if s % 20 == 0:
                seen += follow()
    assert len(r.query("SELECT id FROM blocks")) <= 2  # merged live: 60 commits, one block
    store.close()
    seen += follow()
    assert seen == list(range(1, 301))  # every step once, across the merges
    assert r.df().index.tolist() == list(range(1, 301))
    assert r.df()["grad_norm/a"].tolist() == [s / 2 for s in range(1, 301)]


def test_a_fast_live_run_is_merged_by_what_it_wrote_not_only_by_the_clock(tmp_path):
    """However fast a run writes, a merge follows every `compact_scalars` scalars, so the
    merge at close has at most that many left (the clock's 30 s would leave a fast run's
    last 30 s of writes to the close)."""
    store = RunStore(tmp_path / "run")
    store.compact_every = 1e9  # the clock never says "merge" here
    store.compact_scalars = 400
    r = RunReader(tmp_path / "run")
    held = []
    for s in range(1, 1001):
        store.put(Scalars(s, {"loss/train": float(s), "grad_norm/a": s / 2}))
        if s % 10 == 0:  # a commit of 20 scalars: 100 commits, 2 layouts
            store.flush()
            held.append(len(r.query("SELECT id FROM blocks")))
    assert max(held) <= 2 * (400 // 20 + 1) + 2  # never more than ~one merge's worth
    assert held[-1] < 100
    store.close()
    assert len(r.query("SELECT id FROM blocks")) == 2
    assert r.df()["grad_norm/a"].tolist() == [s / 2 for s in range(1, 1001)]


def test_a_schema_3_folder_reads_and_a_writer_reopening_it_marks_it_4(tmp_path):
    """Schema 3's histogram counts (zlib-packed as they lie) read as they are; a resume's
    writer marks the folder 4 before it writes 4's byte planes beside them, so an older
    nbwatch is told to upgrade instead of misreading them."""
    import zlib

    rng = np.random.default_rng(0)
    counts = [rng.multinomial(50_000, np.full(16, 1 / 16)) for _ in range(2)]
    edges = np.linspace(-1, 1, 17)
    store = RunStore(tmp_path / "run")
    store.put(Histogram(1, "weight/a", edges, counts[0]))
    store.close()
    con = sqlite3.connect(tmp_path / "run" / "nbwatch.db")  # as schema 3 wrote them
    ((ct, data),) = con.execute("SELECT count_type, counts FROM hist_blocks").fetchall()
    assert ct == "u2p+z"
    c = np.frombuffer(zlib.decompress(data), dtype=np.uint8).reshape(2, -1).T.copy()
    con.execute("UPDATE hist_blocks SET count_type = 'u2+z', counts = ?",
                (zlib.compress(c.tobytes(), 6),))
    con.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    con.commit()
    con.close()

    def check(r: RunReader, n: int) -> None:
        steps, _, got = r.histograms("weight/a")
        assert steps.tolist() == list(range(1, n + 1))
        assert np.array_equal(got, np.stack(counts[:n]))

    r = RunReader(tmp_path / "run")
    assert r.meta()["schema_version"] == 3
    check(r, 1)
    store = RunStore(tmp_path / "run")  # a resume
    assert store.meta()["schema_version"] == SCHEMA_VERSION == 4
    store.put(Histogram(2, "weight/a", edges, counts[1]))
    store.close()
    check(RunReader(tmp_path / "run"), 2)


def test_ctrl_c_pressed_while_close_waits_leaves_the_folder_free_and_every_record(tmp_path):
    """Ctrl-C pressed again and again while `close()` commits a big queue: the interrupt
    reaches the caller, the writer thread still commits everything, and the folder's
    lock goes with it. The lock was kept, so the same kernel could not reopen or resume
    the run ('is being written by another nbwatch run')."""
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import signal, threading, time
        from nbwatch.records import Scalars
        from nbwatch.store import RunInUse, RunStore
        store = RunStore({str(run)!r})
        names = [f"layer{{i}}/grad_norm" for i in range(300)]
        for s in range(1, 10001):
            store.put(Scalars(s, {{n: float(s) for n in names}}))
        main, done = threading.main_thread().ident, threading.Event()
        def pester():
            while not done.wait(0.05):
                signal.pthread_kill(main, signal.SIGINT)
        threading.Thread(target=pester, daemon=True).start()
        try:
            store.close()
            print("closed")
        except KeyboardInterrupt:
            print("interrupted")
        done.set()
        # not store._thread.join(): a join cut by Ctrl-C marks a running thread stopped
        # (CPython 3.11); the writer's lock says when it is done
        for _ in range(300):
            try:
                RunStore({str(run)!r}).close()
                print("reopened")
                break
            except RunInUse:
                time.sleep(0.1)
    """)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["interrupted", "reopened"], out.stdout
    reader = RunReader(run)
    assert reader.last_step() == 10000
    assert reader.df()["layer299/grad_norm"].iloc[-1] == 10000.0
    reader.close()


def test_a_reader_kept_across_a_folder_deleted_and_written_again_reads_the_new_run(tmp_path):
    """A follower's reader outlives its folder: `rm -rf runs/exp1` and a new run there. Its
    cached layouts named the old run's keys, so the new run's values came out under the
    wrong columns (grad_norm NaN, loss/val holding another figure)."""
    run = tmp_path / "run"
    store = RunStore(run)
    for s in range(1, 6):
        store.put(Scalars(s, {"loss/train": 1.0, "lr": 0.1}))
    store.close()
    reader = RunReader(run)
    assert reader.df().columns.tolist() == ["loss/train", "lr"]
    shutil.rmtree(run)
    store = RunStore(run)
    for s in range(1, 4):
        store.put(Scalars(s, {"grad_norm": 5.0, "acc": 0.5, "loss/val": 3.0}))
    store.close()
    df = reader.df()
    assert df.index.tolist() == [1, 2, 3]
    assert df.to_dict("list") == {"grad_norm": [5.0] * 3, "acc": [0.5] * 3,
                                  "loss/val": [3.0] * 3}


def test_a_run_dir_too_long_for_sqlite_is_refused_when_the_monitor_is_made(tmp_path):
    """SQLite opens no file whose path passes its limit (512 bytes, the journal's name
    included): Monitor(...) refuses such a run_dir at once, naming its length and the
    limit; the longest one it accepts records, reopens and exports."""
    from nbwatch.demo import TinyGPT
    from nbwatch.monitor.options import MAX_RUN_DIR_BYTES
    from tests.conftest import make_batches, tiny_step

    def path_of(n: int) -> Path:  # a folder path of exactly n bytes, in parts of ≤ 200
        p = tmp_path
        while len(os.fsencode(p)) < n:
            p = p / ("d" * min(200, n - len(os.fsencode(p)) - 1))
        return p

    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for n in (MAX_RUN_DIR_BYTES + 1, 600, 3000):
        long = path_of(n)
        with pytest.raises(ValueError, match=rf"run_dir is too long for SQLite: {n} bytes"
                                             rf".*{MAX_RUN_DIR_BYTES}.*shorter"):
            nbwatch.Monitor(model, opt, run_dir=long)
        assert not long.exists()  # refused before anything is made
    longest = path_of(MAX_RUN_DIR_BYTES)
    mon = nbwatch.Monitor(model, opt, run_dir=longest, config={"lr": 1e-3})
    mon.start(tiny_step, make_batches(4), max_steps=3, display=False).wait()
    run = nbwatch.open_run(longest)
    assert run.step == 3 and run.state == "finished"
    assert run.export_html(tmp_path / "long.html").stat().st_size > 100_000
