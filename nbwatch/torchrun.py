"""`nbwatch.launch`: start a `torchrun` job from a notebook and follow its run (attach)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .attached import Attached
from .counts import integral
from .lifecycle import WAITING, RunState
from .store import check_no_writer, is_run_dir
from .store.liveness import ENDED, RunFailed

TAIL_LINES = 15  # lines of the job's output a failure before its run opened shows
_TAIL_BYTES = 64 * 1024
# where torchrun's own report of a failed worker begins (its traceback, its summary)
_TORCHRUN_REPORT = "] failed (exitcode:"


class Launched(Attached):
    """The run of a job `launch` started: an attached run that also watches the job's
    process, so that a job that ends before its run opens reads `failed` (its exit code and
    the end of its output), not `waiting` for ever. A run in the folder from before the
    launch is not the job's until the job opens it anew."""

    def __init__(self, run_dir: Path, script: Path, log: Path):
        super().__init__(run_dir)
        self.script, self.log = script, log
        self._log_from = log.stat().st_size if log.is_file() else 0  # the log is appended to
        self._before = self._opened()

    def _opened(self) -> Any:
        """When the folder's run was last opened (meta `opened`; `started` before it was
        kept), None before any was."""
        if not is_run_dir(self.run_dir):
            return None
        meta = self.meta
        return meta.get("opened", meta.get("started"))

    @property
    def exists(self) -> bool:
        """True once the job has opened its run in the folder."""
        return is_run_dir(self.run_dir) and self._opened() != self._before

    @property
    def state(self) -> str:
        code = self.process.poll()
        if not self.exists:
            return WAITING if code is None else RunState.FAILED
        state = super().state
        return "failed" if code not in (None, 0) and state not in ENDED else state

    def wait_started(self, timeout: float = 60.0, poll: float = 0.1) -> Launched:
        """Block until the job has opened its run; raise RunFailed should it end first,
        TimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        while not self.exists:
            if self.process.poll() is not None:
                raise self.error or RunFailed(f"the torchrun job of {self.script} ended")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the torchrun job opened no run in {self.run_dir} within "
                                   f"{timeout:g} s; its output so far is in {self.log}")
            time.sleep(poll)
        return self

    @property
    def step(self) -> int:
        return super().step if self.exists else 0

    @property
    def error(self) -> RunFailed | None:
        code = self.process.poll()
        if not self.exists:
            return RunFailed(self._ended_unopened(code)) if code is not None else None
        own = super().error
        if own is None and code not in (None, 0) and super().state not in ENDED:
            return RunFailed(f"the torchrun job of {self.script} exited with code {code} "
                             f"while its run was live; the end of its output ({self.log}):\n"
                             + self._output_tail())
        return own

    def _ended_unopened(self, code: int) -> str:
        if code == 0:
            return (f"the torchrun job of {self.script} exited (code 0) without opening a run "
                    f"in {self.run_dir}: create nbwatch.Monitor(..., run_dir=None) (or a "
                    "callback without run_dir) in the script, which then writes there")
        return (f"the torchrun job of {self.script} exited with code {code} before its run "
                f"opened in {self.run_dir}: fix the error below and launch again; the end of "
                f"its output ({self.log}):\n" + self._output_tail())

    def _output_tail(self) -> str:
        """The last TAIL_LINES lines of this job's output before torchrun's own report of
        the failure (its traceback and summary, which name no cause of the script's)."""
        try:
            with open(self.log, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(self._log_from, size - _TAIL_BYTES))
                text = f.read().decode("utf-8", errors="replace")
        except OSError as e:
            return f"(not readable: {e})"
        cut = text.find(_TORCHRUN_REPORT)
        if cut >= 0:
            text = text[:text.rfind("\n", 0, cut) + 1]
        return "\n".join(text.rstrip().splitlines()[-TAIL_LINES:]) or "(no output)"


def launch(script: str | Path, nproc: int = 2, run_dir: str | Path | None = None,
           args: list[str] | tuple[str, ...] = (), log: str | Path | None = None,
           display: bool | None = None) -> Launched:
    """Start `torchrun --nproc_per_node=nproc script args…` and attach to its run.

    The job's `nbwatch.Monitor(run_dir=None)` writes into `run_dir` (passed through the
    `NBWATCH_RUN_DIR` environment variable). Returns the attached run; its `.process` is
    the torchrun process, whose output goes to `log` (default `run_dir/torchrun.log`).
    Should the job end before it opens its run, the handle reads `failed` and `wait()`
    raises RunFailed with the exit code and the end of that output.

    >>> job = nbwatch.launch("train.py", nproc=2, run_dir="runs/ddp")
    >>> job.pause(); job.resume(); job.process.wait()
    """
    if not integral(nproc) or nproc < 1:
        raise ValueError(f"nproc must be an int ≥ 1 (the processes torchrun starts on this "
                         f"machine, e.g. one a GPU), got {nproc!r}; e.g. nproc=2")
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"no training script at {script}")
    run_dir = Path(run_dir) if run_dir is not None else Path("runs") / time.strftime(
        "%Y%m%d-%H%M%S")
    check_no_writer(run_dir)  # else the handle would read that other run as the job's
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(log) if log is not None else run_dir / "torchrun.log"
    job = Launched(run_dir, script, log_path)
    env = {**os.environ, "NBWATCH_RUN_DIR": str(run_dir)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={int(nproc)}", str(script), *map(str, args)]
    with open(log_path, "ab") as out:
        job.process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if display is None:
        from .notebook import in_notebook

        display = in_notebook()
    if display:
        job.show()
    return job
