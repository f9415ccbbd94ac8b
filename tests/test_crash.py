"""`kill -9` of a real training subprocess: the store keeps all but the last second, and
every checkpoint left on disk loads."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import torch

from nbwatch.store import RunReader

SCRIPT = textwrap.dedent("""
    import sys, time, torch
    import nbwatch
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches, tiny_step

    def step(model, batch):
        time.sleep(0.01)
        return tiny_step(model, batch)

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=sys.argv[1])
    mon.start(step, make_batches(), max_steps=100_000, checkpoint_every=7, display=False)
    mon.wait()
""")


def test_kill_9_loses_at_most_the_last_second(tmp_path):
    run = tmp_path / "run"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(run)], cwd=root,
                            env={**os.environ, "PYTHONPATH": root})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if (run / "nbwatch.db").exists() and RunReader(run).last_step() >= 60:
                    break
            except sqlite3.OperationalError:  # the writer is still creating the schema
                pass
            assert proc.poll() is None, "training subprocess died on its own"
            time.sleep(0.1)
        else:
            raise AssertionError("the subprocess did not reach step 60 in time")
        killed_at = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    reader = RunReader(run)
    walls = reader.walls()
    assert killed_at - walls.iloc[-1] < 1.0, "more than the last second of steps was lost"
    assert walls.index.tolist() == list(range(1, len(walls) + 1))  # no hole before the end
    checkpoints = sorted((run / "checkpoints").glob("step_*.pt"))
    assert checkpoints
    for path in checkpoints:
        ck = torch.load(path, weights_only=True)
        assert ck["step"] % 7 == 0 and set(ck["model"]) >= {"head.weight", "tok_emb.weight"}
    assert reader.meta()["state"] == "running"  # what a reader sees of a run that died
    reader.close()
