import sqlite3

from nbwatch.store.recover import fold


class KeptCursors(sqlite3.Connection):
    """A connection whose cursors something else keeps alive (a `gc.get_objects()` in
    another thread, a debugger): a statement not run to its end stays active."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept: list[sqlite3.Cursor] = []

    def execute(self, *args, **kwargs):  # type: ignore[override]
        cur = super().execute(*args, **kwargs)
        self.kept.append(cur)
        return cur


def test_fold_leaves_wal_mode_while_its_cursors_are_kept_alive(tmp_path):
    db = tmp_path / "nbwatch.db"
    con = sqlite3.connect(db, factory=KeptCursors, isolation_level=None)
    con.executescript("PRAGMA journal_mode=WAL; CREATE TABLE t (x); INSERT INTO t VALUES (1);")
    assert (tmp_path / "nbwatch.db-wal").exists()
    assert fold(con, tries=2) is None
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert not (tmp_path / "nbwatch.db-wal").exists()
    con.close()
