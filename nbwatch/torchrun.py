"""`nbwatch.launch`: start a `torchrun` job from a notebook and follow its run (attach)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def launch(script: str | Path, nproc: int = 2, run_dir: str | Path | None = None,
           args: list[str] | tuple[str, ...] = (), log: str | Path | None = None,
           display: bool | None = None) -> Any:
    """Start `torchrun --nproc_per_node=nproc script args…` and attach to its run.

    The job's `nbwatch.Monitor(run_dir=None)` writes into `run_dir` (passed through the
    `NBWATCH_RUN_DIR` environment variable). Returns the attached run; its `.process` is
    the torchrun process, whose output goes to `log` (default `run_dir/torchrun.log`).

    >>> job = nbwatch.launch("train.py", nproc=2, run_dir="runs/ddp")
    >>> job.pause(); job.resume(); job.process.wait()
    """
    import time

    from .attach import attach

    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"no training script at {script}")
    run_dir = Path(run_dir) if run_dir is not None else Path("runs") / time.strftime(
        "%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(log) if log is not None else run_dir / "torchrun.log"
    env = {**os.environ, "NBWATCH_RUN_DIR": str(run_dir)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(script), *map(str, args)]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    job = attach(run_dir, display=display)
    job.process = proc
    return job
