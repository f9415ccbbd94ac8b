"""`benchmarks/gpu_check.py` is what a session with a GPU runs first, and CI never has
one: its code runs here on small shapes in the GPU's order (decided on the device, read
a step later), so that the script works the first time it meets a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_every_loop_on_small_shapes_in_the_gpus_order(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick",
         "--gpu-order", "--only", "gpt2,trainer,foreach,clip", "--steps", "6",
         "--trace", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "FAILED" not in out, out[-3000:]
    rows = [line.split("|")[1:4] for line in proc.stdout.splitlines()
            if line.startswith("| ") and "bare ms/step" not in line]
    got = {(w.strip(), v.strip()) for w, _, v in rows}
    assert got == {("gpt2", "log"), ("gpt2", "start"), ("trainer", "callback"),
                   ("foreach", "log"), ("foreach", "start"), ("clip", "log")}, proc.stdout
    for line in proc.stdout.splitlines():  # each watched run recorded its own time
        if line.startswith("| ") and "bare ms/step" not in line:
            own, _, step = line.rsplit("|", 2)[-2].split("·")
            assert float(own) > 0 and float(step) > 0, line
    for name in ("gpt2", "foreach", "clip"):  # each own loop's traces, bare and watched
        for v in ("bare", "log"):
            assert (tmp_path / f"{name}-{v}.json").stat().st_size > 0
            assert "Optimizer.step" in (tmp_path / f"{name}-{v}.txt").read_text()
