"""Making a run folder's store: its tables appear all at once to a reader."""

import gc
import sqlite3

import pytest

import nbwatch
from nbwatch.run import RunNotStarted
from nbwatch.store import DB_NAME, schema
from nbwatch.store.migrate import open_for_writing


def test_a_store_cut_off_while_its_tables_are_made_shows_a_reader_none_of_them(
        tmp_path, monkeypatch):
    """The writer makes every table in one transaction: a reader of a folder being created
    finds no run yet (RunNotStarted), never the meta table without the others (where
    open_run(...).step raised a raw 'no such table: walls')."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    # the schema's statements up to `walls`, then one that fails: a writer cut off there
    head = schema._SCHEMA[:schema._SCHEMA.index("CREATE TABLE IF NOT EXISTS walls")]
    monkeypatch.setattr(schema, "_SCHEMA", head + "CREATE TABLE broken (;")
    try:  # (no excinfo kept: the cut-off writer's connection is dropped, as at its death)
        open_for_writing(run_dir, run_dir / DB_NAME, network=False)
    except sqlite3.OperationalError:
        pass
    else:
        pytest.fail("the broken schema was accepted")
    gc.collect()  # (its traceback's frames hold it in a cycle)
    with pytest.raises(RunNotStarted, match="holds no nbwatch records"):
        nbwatch.open_run(run_dir)


def test_a_store_made_whole_reads_as_a_run_with_no_steps(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    con = open_for_writing(run_dir, run_dir / DB_NAME, network=False)
    con.close()
    run = nbwatch.open_run(run_dir)
    assert run.step == 0
    assert run.df.empty
