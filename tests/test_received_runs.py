"""Run folders received from someone else, or crafted: what they can and cannot make nbwatch
do. Each folder here starts as a real run, then has its meta or database edited the way a
hostile or careless sender could (issue 46)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from tests.conftest import make_batches, tiny_step

ROOT = Path(__file__).resolve().parents[1]


def nbwatch_cli(*args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nbwatch.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _write(run_dir: Path, config: dict, baseline: Path | None = None) -> Path:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=run_dir, config=config, baseline=baseline)
    mon.start(tiny_step, make_batches(4), max_steps=3, display=False)
    mon.wait()
    return run_dir


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """One real finished run, copied and edited by each test."""
    return _write(tmp_path_factory.mktemp("made") / "run", {"lr": 1e-3, "seed": 0})


def copy_run(made: Path, to: Path, **meta: object) -> Path:
    """A copy of the made run with `meta` keys overwritten by raw JSON text (a `bytes`
    value) or by a value's JSON."""
    shutil.copytree(made, to, ignore=shutil.ignore_patterns("checkpoints"))
    con = sqlite3.connect(to / "nbwatch.db")
    with con:
        for key, value in meta.items():
            text = value.decode() if isinstance(value, bytes) else json.dumps(value)
            con.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, text))
    con.close()
    return to


# 12 -- an old-format folder on a read-only mount -------------------------------------------
@pytest.fixture
def readonly_view(tmp_path):
    """`view()` bind-mounts a folder read-only; skipped where mounting is not permitted."""
    mounted: list[Path] = []

    def view(folder: Path) -> Path:
        at = tmp_path / "readonly"
        at.mkdir()
        if subprocess.run(["mount", "--bind", "-o", "ro", str(folder), str(at)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot bind-mount a read-only view here")
        mounted.append(at)
        if subprocess.run(["touch", str(at / "probe")], capture_output=True).returncode == 0:
            pytest.skip("the bind mount is not read-only here")
        return at

    yield view
    for at in mounted:
        subprocess.run(["umount", str(at)], check=False)


def test_an_old_folder_on_a_read_only_mount_asks_for_a_writable_copy(tmp_path, readonly_view):
    """A schema-1 folder must be migrated once before it is read: where it cannot be written,
    open_run and `nbwatch export` say so and ask for a copy, not "damaged"."""
    folder = tmp_path / "received"
    shutil.copytree(ROOT / "tests" / "data" / "run_v1", folder / "old")
    view = readonly_view(folder) / "old"
    with pytest.raises(RuntimeError, match=r"schema 1.*cannot be written.*copy the run folder"):
        nbwatch.open_run(view)
    out = nbwatch_cli("export", view, "-o", tmp_path / "old.html")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "damaged" not in line and "readonly database" not in line.split("(")[0], line
    for words in ("schema 1", "cannot be written", "copy the run folder"):
        assert words in line, line
    assert not (tmp_path / "old.html").exists()


# 13 -- meta that is valid SQLite but not what nbwatch wrote ---------------------------------
def test_ls_lists_every_run_when_one_has_crafted_meta(made, tmp_path):
    """A config that is a JSON list, a value nested past Python's recursion limit, a value
    that is not JSON: `ls` lists the other runs, names each bad file, no traceback."""
    root = tmp_path / "runs"
    copy_run(made, root / "a")
    copy_run(made, root / "listed", config=[1, 2, 3])
    copy_run(made, root / "deep", name=b"[" * 100_000 + b"]" * 100_000)
    copy_run(made, root / "notjson", config=b"{not json")
    copy_run(made, root / "z", config={"lr": 3e-4, "seed": 0})
    out = nbwatch_cli("ls", root)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert sorted(rows) == ["a", "listed", "z"], out.stdout
    assert "0.0003" in rows["z"]
    for bad in ("listed", "deep", "notjson"):
        (note,) = [line for line in out.stderr.splitlines() if f"{root / bad}" in line]
        assert str(root / bad / "nbwatch.db") in note, note
    assert "config" in [line for line in out.stderr.splitlines() if "listed" in line][0]

    # the API names the file too, and the list config reads as no config
    for bad in ("deep", "notjson"):
        with pytest.raises(ValueError, match=str(root / bad / "nbwatch.db")):
            nbwatch.open_run(root / bad).meta.get("name")
        out = nbwatch_cli("export", root / bad, "-o", tmp_path / "x.html")
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert str(root / bad / "nbwatch.db") in out.stderr.strip(), out.stderr
    with pytest.warns(UserWarning, match="JSON list"):
        assert nbwatch.open_run(root / "listed").config == {}
    # the dashboard of a run (`%nbwatch RUN`) reads the meta through the same check
    from nbwatch.widget import Dashboard

    with pytest.raises(ValueError, match=str(root / "notjson" / "nbwatch.db")):
        Dashboard.for_run(root / "notjson")
    with pytest.warns(UserWarning) as got:
        assert nbwatch.compare(root).config_diff.loc["z", "lr"] == 3e-4
    said = [str(w.message) for w in got]
    assert any("JSON list" in m for m in said) and sum("skipped" in m for m in said) == 2


# 15 -- baselines named by a received folder -------------------------------------------------
def test_a_received_runs_baselines_cannot_reach_the_receivers_own_runs(made, tmp_path):
    """A received run's meta names baselines on the receiver's machine (absolute, `../`):
    its export must not carry them. A baseline beside the run (a copied `runs/` folder) is
    still drawn."""
    secret = _write(tmp_path / "mine" / "runs" / "secret", {"token": "SECRET-TOKEN-123"})
    inbox = tmp_path / "inbox" / "runs"
    beside = copy_run(made, inbox / "beside")
    (inbox / "link").symlink_to(secret)  # a link beside it leads out of the folder
    received = copy_run(made, inbox / "theirs", baselines=[
        str(secret), "../../mine/runs/secret", str(tmp_path / "mine" / "runs"), "..",
        "/../" + str(secret), "link", "x" * 300, "nul\0", "beside"])
    out = nbwatch_cli("export", received, "-o", tmp_path / "theirs.html")
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "theirs.html").read_text(encoding="utf-8")
    assert "SECRET-TOKEN-123" not in text
    assert "dropped" in out.stderr and "Traceback" not in out.stderr
    state = json.loads(text.split('id="nbw-state">')[1].split("</script>")[0])
    assert [b["path"] for b in state["panels"]["loss"]["baselines"]] == [str(beside)]
    with pytest.warns(UserWarning, match="dropped: no run of that name beside it"):
        page = nbwatch.open_run(received).export_html(tmp_path / "api.html")
    assert "SECRET-TOKEN-123" not in page.read_text(encoding="utf-8")


def test_a_baseline_given_from_elsewhere_is_drawn_by_its_monitor_only(tmp_path):
    """`Monitor(baseline=...)` may name a run anywhere: that Monitor's dashboard and export
    draw it. Another process reading the folder takes only what its meta names beside it."""
    other = _write(tmp_path / "a" / "exp0", {"token": "OTHER-CONFIG-1"})
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters()),
                          run_dir=tmp_path / "b" / "exp1", baseline=other)
    mon.start(tiny_step, make_batches(4), max_steps=3, display=False).wait()
    assert "OTHER-CONFIG-1" in mon.export_html(tmp_path / "own.html").read_text(encoding="utf-8")
    out = nbwatch_cli("export", mon.run_dir, "-o", tmp_path / "later.html")
    assert out.returncode == 0 and "dropped" in out.stderr, out.stderr
    assert "OTHER-CONFIG-1" not in (tmp_path / "later.html").read_text(encoding="utf-8")


def test_a_baseline_beside_a_run_folder_that_is_a_link_is_drawn(made, tmp_path):
    """`runs/exp1 -> /scratch/exp1` (a run_dir that is a link) with its baseline `runs/exp0`
    beside the link: that baseline is beside the run, and is drawn."""
    runs, scratch = tmp_path / "runs", tmp_path / "scratch"
    runs.mkdir()
    scratch.mkdir()
    base = copy_run(made, runs / "exp0")
    real = copy_run(made, scratch / "exp1", baselines=[str(base)])
    (runs / "exp1").symlink_to(real)
    from nbwatch.panels.baseline import resolve

    assert resolve(str(base), runs / "exp1") == runs / "exp0"


# 16 -- control characters in what the CLI prints -------------------------------------------
OSC52 = "\x1b]52;c;cm0gLXJmIH4=\x07"
CLEAR = "\x1b[2J"


def test_ls_and_export_print_control_characters_visibly(made, tmp_path):
    root = tmp_path / "runs"
    copy_run(made, root / f"osc{OSC52}")
    copy_run(made, root / f"two\nlines{CLEAR}")
    bad = copy_run(made, root / f"failed{CLEAR}", state="failed")
    con = sqlite3.connect(bad / "nbwatch.db")
    with con:
        con.execute("INSERT INTO events (step, wall, kind, severity, message, data) VALUES"
                    " (3, 0, 'error', 'error', ?, '{}')", (f"RuntimeError: boom{OSC52}",))
    con.close()
    copy_run(made, root / f"meta{CLEAR}", config=b"{not json")
    copy_run(made, root / os.fsdecode(b"bytes\xffname"))  # not UTF-8: no stream encodes it
    out = nbwatch_cli("ls", root)
    assert out.returncode == 0, out.stderr
    for text in (out.stdout, out.stderr):
        assert "\x1b" not in text and "\x07" not in text, repr(text)
    lines = out.stdout.splitlines()
    assert len(lines) == 5, out.stdout  # the header and one line per readable run
    assert any(line.startswith("bytes\\udcffname ") for line in lines), lines
    assert any(line.startswith("osc\\x1b]52;c;cm0gLXJmIH4=\\x07 ") for line in lines), lines
    assert any(line.startswith("two\\nlines\\x1b[2J ") for line in lines), lines
    assert any("boom\\x1b]52" in line for line in lines), lines
    assert "meta\\x1b[2J" in out.stderr

    # an error and an export's message name the folder the same way
    out = nbwatch_cli("export", root / f"meta{CLEAR}", "-o", tmp_path / "m.html")
    assert out.returncode == 1 and "\x1b" not in out.stderr and "meta\\x1b[2J" in out.stderr
    out = nbwatch_cli("export", root / f"two\nlines{CLEAR}", "-o", tmp_path / f"a{CLEAR}.html")
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and len(out.stdout.splitlines()) == 1, out.stdout
    assert "a\\x1b[2J.html" in out.stdout


# 17 -- links and FIFOs planted in a received folder -----------------------------------------
def test_the_default_export_of_a_received_folder_writes_only_inside_it(made, tmp_path):
    """`-o` naming a link or a FIFO writes through it (tests/test_cli.py), but one planted
    in a received run folder (report.html, the default output, or the name of its temporary
    file) is replaced, never followed nor waited on: the files it leads to are untouched."""
    victim = tmp_path / "mine" / "notes.html"
    victim.parent.mkdir()
    victim.write_text("mine")
    linked = copy_run(made, tmp_path / "linked")
    (linked / "report.html").symlink_to(victim)
    planted = copy_run(made, tmp_path / "planted")
    (planted / "report.html.tmp").symlink_to(victim)
    fifo = copy_run(made, tmp_path / "fifo")
    os.mkfifo(fifo / "report.html")
    for run in (linked, planted, fifo):
        out = nbwatch_cli("export", run, timeout=60)
        assert out.returncode == 0, out.stderr
        page = run / "report.html"
        assert page.is_file() and not page.is_symlink(), run
        assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert victim.read_text() == "mine"
