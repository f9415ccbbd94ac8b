"""What the run ran on: versions, devices, host, git commit."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from typing import Any

import torch


def git_commit(cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=2
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def environment(gpu_names: list[str]) -> dict[str, Any]:
    from ._version import __version__

    return {
        "nbwatch": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpu_names,
        "torch_threads": torch.get_num_threads(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "pid": os.getpid(),
        "cwd": os.getcwd(),
        "argv": sys.argv,
        "git_commit": git_commit(),
    }
