"""The files whose expectations a GPU's order changes most (a step read at the next step's
end: its own time, its row's wall time, a rewind's batches, an own loop's reads, the
controls and checkpoints), run again in that order on the CPU (`NBWATCH_GPU_ORDER=1`),
so that CI, which never has a GPU, holds the path a GPU takes to the same behaviour. The
whole suite passes that way too (docs/performance.md); this is the part run each time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("test_own_time.py", "test_step_records.py", "test_rewind.py", "test_monitor_log.py",
         "test_monitor_log_controls.py", "test_checkpoint.py", "test_controls.py",
         "recorder/test_layer_changes.py")


def test_the_order_sensitive_files_pass_in_a_gpus_order():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         *(str(ROOT / "tests" / f) for f in FILES)],
        cwd=ROOT, env={**os.environ, "NBWATCH_GPU_ORDER": "1"}, capture_output=True,
        text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]  # "72 passed, 4 warnings in 36 s"
    assert re.match(r"\d+ passed", summary) and "failed" not in summary, summary
