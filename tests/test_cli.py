"""The command line as a user meets it, through real subprocesses: `--help` and `--version`
without torch, every user error one line on stderr with a nonzero status, `-o` taking a
folder, and `nbwatch ls` saying why a run failed."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.run import RunNotStarted
from tests.conftest import make_batches, tiny_step

ROOT = Path(__file__).resolve().parents[1]


def nbwatch_cli(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nbwatch.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def assert_one_line_error(out: subprocess.CompletedProcess, *words: str) -> str:
    """A user error: nonzero status, nothing on stdout, one line on stderr naming `words`."""
    assert out.returncode != 0, out
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert out.stdout == "", out.stdout
    return lines[0]


def _run(root: Path, name: str, fail_at: int | None = None, steps: int = 4) -> Path:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calls = [0]

    def step(m, batch):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("the loss went NaN\nand a second line ls must not show")
        return tiny_step(m, batch)

    mon = nbwatch.Monitor(model, opt, run_dir=root / name, config={"fails": fail_at is not None})
    mon.start(step, make_batches(4), max_steps=steps, display=False)
    with pytest.raises(RuntimeError) if fail_at else contextlib.nullcontext():
        mon.wait()
    return root / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """runs/ok (finished, no val), runs/bad (failed at step 3), runs/garbage (no store)."""
    root = tmp_path_factory.mktemp("runs")
    _run(root, "ok")
    _run(root, "bad", fail_at=3)
    (root / "garbage").mkdir()
    (root / "garbage" / "nbwatch.db").write_bytes(os.urandom(8192))
    return root


def test_help_and_version_do_not_import_torch():
    probe = (
        "import contextlib, io, json, sys\n"
        "from nbwatch.cli import main\n"
        "codes = []\n"
        "for argv in (['--help'], ['demo', '--help'], ['export', '--help'], ['--version']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as e:\n"
        "            codes.append(e.code)\n"
        "print(json.dumps({'codes': codes, 'torch': 'torch' in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"codes": [0, 0, 0, 0], "torch": False}
    # the package itself is light until a heavy name is used, and every public name works
    lazy = subprocess.run(
        [sys.executable, "-c",
         "import sys, nbwatch; light = 'torch' not in sys.modules\n"
         "import nbwatch.comparison, nbwatch.attached  # the modules that define them\n"
         "names = [n for n in nbwatch.__all__ if not callable(getattr(nbwatch, n))]\n"
         "print(light, names, nbwatch.compare.__module__, nbwatch.attach.__module__)"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert lazy.stdout.split() == ["True", "[]", "nbwatch.comparison", "nbwatch.attached"], lazy


def test_version_is_the_installed_one():
    out = nbwatch_cli("--version")
    assert out.returncode == 0 and out.stdout == f"nbwatch {version('nbwatch')}\n", out


def test_every_option_has_help():
    from nbwatch.cli import parser

    sub = next(a for a in parser()._actions if a.dest == "cmd")
    for name, p in sub.choices.items():
        for a in p._actions:
            assert a.help, f"nbwatch {name} {'/'.join(a.option_strings) or a.dest} has no help"
    text = nbwatch_cli("demo", "--help").stdout
    assert "optimizer steps to train (default: 1000)" in text and "seconds between" in text
    from nbwatch.store.liveness import STALE_AFTER

    assert f"(default: {STALE_AFTER:g})" in " ".join(nbwatch_cli("ls", "--help").stdout.split())


def test_user_errors_are_one_line_on_stderr(runs, tmp_path):
    db = runs / "ok" / "nbwatch.db"
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    for target in (db, runs / "ok" / "log.jsonl", runs / "ok" / "checkpoints" / "x.html"):
        assert_one_line_error(nbwatch_cli("export", runs / "ok", "-o", target),
                              "refusing to export over", "report.html")
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before  # the run is untouched
    assert nbwatch.open_run(runs / "ok").step == 4

    assert_one_line_error(nbwatch_cli("export", runs / "garbage"), "nbwatch export:",
                          str(runs / "garbage" / "nbwatch.db"), "damaged")
    assert_one_line_error(nbwatch_cli("export", runs / "nope"), "holds no nbwatch run")
    assert_one_line_error(nbwatch_cli("ls", runs / "nope"), "is not a folder")
    assert_one_line_error(nbwatch_cli("ls", runs, "--where", "fails"), "KEY=VALUE")
    for bad in ("-5", "0", "ten"):
        out = nbwatch_cli("demo", "--steps", bad, "--run-dir", tmp_path / "d")
        assert out.returncode == 2
        assert_one_line_error(out, "--steps", "positive integer", repr(bad), "--help")
    assert_one_line_error(nbwatch_cli("demo", "--print-every", "-1"), "--print-every")
    assert_one_line_error(nbwatch_cli("demo", "--run-dir", runs / "ok"), "already holds a run")
    assert not (tmp_path / "d").exists()
    out = nbwatch_cli("nosuchcommand")  # argparse's own errors: one line too
    assert out.returncode == 2
    assert_one_line_error(out, "invalid choice", "nosuchcommand")


def test_recover_says_what_it_found(runs):
    """A whole folder: nothing to recover (it said "recovered"); a damaged file: exit 1,
    damaged, in one line (it said "recovered" and exited 0)."""
    ok = nbwatch_cli("recover", runs / "ok")
    assert ok.returncode == 0 and "nothing to recover" in ok.stdout and not ok.stderr, ok
    assert_one_line_error(nbwatch_cli("recover", runs / "garbage"), "damaged",
                          "cannot mend", "checkpoints/")
    assert_one_line_error(nbwatch_cli("recover", runs / "nope"), "holds no nbwatch.db")


def test_output_folder_gets_the_run_name(runs, tmp_path):
    out = nbwatch_cli("export", runs / "ok", "-o", f"{tmp_path}/new/sub/")  # created
    assert out.returncode == 0, out.stderr
    page = tmp_path / "new" / "sub" / "ok.html"
    assert page.is_file() and page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert str(page) in out.stdout
    (tmp_path / "existing").mkdir()
    assert nbwatch_cli("export", runs / "ok", "-o", tmp_path / "existing").returncode == 0
    assert (tmp_path / "existing" / "ok.html").is_file()
    # a file name is a file, its folders created
    assert nbwatch_cli("export", runs / "ok", "-o", tmp_path / "a" / "b.html").returncode == 0
    assert (tmp_path / "a" / "b.html").is_file()
    (tmp_path / "notes.txt").write_text("mine")
    assert_one_line_error(nbwatch_cli("export", runs / "ok", "-o", f"{tmp_path}/notes.txt/"),
                          "is a file, not a folder")
    assert_one_line_error(nbwatch_cli("export", runs / "ok", "-o", tmp_path / "notes.txt"),
                          "refusing to overwrite")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_ls_says_why_a_run_failed_and_marks_missing_values_one_way(runs):
    out = nbwatch_cli("ls", runs)
    assert out.returncode == 0, out.stderr
    assert f"skipped {runs / 'garbage'}" in out.stderr  # a damaged run: named, skipped
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert list(rows) == ["bad", "ok"]
    assert rows["bad"].split()[1] == "failed"
    assert rows["bad"].endswith("(RuntimeError: the loss went NaN)")  # the first line only
    assert rows["ok"].split()[1] == "finished" and "(" not in rows["ok"]
    for line in rows.values():  # no val_fn: best val and its step are missing, said as "–"
        cells = line.split()
        assert cells[3:5] == ["–", "–"], line
        assert " - " not in line, line
    assert nbwatch.compare([runs / "bad"]).summary["error"].iloc[0] == (
        "RuntimeError: the loss went NaN")


def test_ls_into_a_reader_that_closes_early_says_nothing(runs):
    """`nbwatch ls | head -1` printed 'nbwatch ls: [Errno 32] Broken pipe' as if ls had
    failed: a closed pipe ends the listing quietly, with the shell's SIGPIPE status."""
    proc = subprocess.Popen([sys.executable, "-m", "nbwatch.cli", "ls", str(runs)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before ls writes its first line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    assert "Broken pipe" not in err and "Exception ignored" not in err, err
    assert f"skipped {runs / 'garbage'}" in err  # what it says on stderr still comes


def test_ctrl_c_stops_the_demo_in_one_line(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "nbwatch.cli", "demo", "--steps", "100000", "--print-every",
         "0.2", "--run-dir", str(tmp_path / "demo")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # a progress line: training is under way
            line = proc.stdout.readline()
            if line.startswith("step ") or not line:
                break
        assert line.startswith("step "), line
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("interrupted: stopped at step"), stderr
    assert nbwatch.open_run(tmp_path / "demo").state == "stopped"


def read_fifo_during(fifo: Path, *args: object) -> tuple[str, subprocess.CompletedProcess]:
    """What `nbwatch *args` writes into `fifo` (its reader end held open meanwhile, so a
    process that never opens it cannot block the test), and how the process ended."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    proc = subprocess.Popen([sys.executable, "-m", "nbwatch.cli", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    got, deadline = b"", time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ended = proc.poll() is not None
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:  # a writer holds it open, nothing new yet
                chunk = None
            if chunk:
                got += chunk
            elif ended:
                break
            else:
                time.sleep(0.01)
        out, err = proc.communicate(timeout=10)
    finally:
        os.close(fd)
        if proc.poll() is None:
            proc.kill()
    return got.decode("utf-8"), subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_export_writes_through_a_link_or_a_pipe_and_leaves_them_in_place(runs, tmp_path):
    """`-o` naming a symlink (to a file, a FIFO, or stdout) or a FIFO writes through it:
    the link and the FIFO are still there afterwards, and the page went where they lead."""
    page = tmp_path / "kept" / "page.html"
    page.parent.mkdir()
    page.write_text("old")
    (tmp_path / "link.html").symlink_to(page)
    out = nbwatch_cli("export", runs / "ok", "-o", tmp_path / "link.html")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "link.html").is_symlink() and page.read_text().startswith("<!DOCTYPE")

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "to-fifo.html").symlink_to(fifo)
    for target in (fifo, tmp_path / "to-fifo.html"):
        got, done = read_fifo_during(fifo, "export", runs / "ok", "-o", target)
        assert done.returncode == 0, done.stderr
        assert got.startswith("<!DOCTYPE html>") and got.endswith("</html>\n"), got[-200:]
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert (tmp_path / "to-fifo.html").is_symlink()

    # stdout a pipe, through a link to /dev/stdout: the page alone on stdout
    (tmp_path / "out.html").symlink_to("/dev/stdout")
    out = nbwatch_cli("export", runs / "ok", "-o", tmp_path / "out.html")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("<!DOCTYPE html>") and out.stdout.endswith("</html>\n")
    assert (tmp_path / "out.html").is_symlink()
    assert os.readlink(tmp_path / "out.html") == "/dev/stdout"


PAUSED_BY_NAN = """
import sys, torch, nbwatch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with nbwatch.Monitor(model, opt, run_dir=sys.argv[1], display=False) as mon:
    for step in range(1, 100_000):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.log(loss=torch.tensor(float("nan")) if step == 5 else loss)
print("STATE", mon.state, mon.step, flush=True)
"""


def test_a_script_paused_by_an_alert_is_resumed_and_stopped_from_a_shell(tmp_path):
    """A script whose NaN loss paused it (the nonfinite rule's default) waits for ever
    unless someone answers: its stderr line names the shell commands, which resume it and
    then stop it; each says what the run did, and one sent to an ended run is refused in
    one line."""
    run = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_BY_NAN, str(run)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def paused() -> bool:
            try:  # a folder being created says RunNotStarted until its tables are there
                return nbwatch.open_run(run).state == "paused"
            except RunNotStarted:
                return False

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ((run / "nbwatch.db").exists() and paused()):
            time.sleep(0.1)
        assert nbwatch.open_run(run).state == "paused"
        resumed = nbwatch_cli("resume", run)
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.startswith("r: resumed at step 5"), resumed.stdout
        saved = nbwatch_cli("checkpoint", run)  # its applied outcome: a checkpoint event
        assert saved.returncode == 0 and "r: manual checkpoint at step" in saved.stdout, saved
        stopped = nbwatch_cli("stop", run)
        assert stopped.returncode == 0 and "r: stop requested at step" in stopped.stdout, stopped
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert f"`nbwatch resume {run}`" in err
    assert "STATE stopped" in out and nbwatch.open_run(run).state == "stopped"
    assert_one_line_error(nbwatch_cli("resume", run), "cannot resume", "stopped")
