"""`%nbwatch`: show the current run's dashboard, reopen a run folder, or list runs.

    %nbwatch               the dashboard of the most recently started Monitor
    %nbwatch RUN_DIR       a read-only dashboard of a run folder (finished or running)
    %nbwatch ls [ROOT] [--where KEY=VALUE] [--sort best]   the runs under ROOT (default: runs)
    %nbwatch export|pause|resume|stop|checkpoint|recover RUN_DIR ...   as `nbwatch ...`

Button clicks are handled while the kernel is idle: a cell blocked in `mon.wait()`
(or any long cell) holds them until it returns.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from .notebook import enable_colab_widgets, latest, remember

__all__ = ["latest", "nbwatch_magic", "register", "remember"]


def nbwatch_magic(line: str) -> Any:
    """`%nbwatch`, `%nbwatch RUN_DIR`, `%nbwatch ls [ROOT]`, `%nbwatch export RUN_DIR`, …"""
    from .widget import Dashboard

    try:
        args = shlex.split(line)
    except ValueError as e:  # an unclosed quote: said in a line, not a traceback
        print(f"%nbwatch: {e} in {line!r}; quote a path with spaces whole: "
              "%nbwatch \"runs/my run\"")
        return None
    if not args:
        mon = latest()
        if mon is None:
            print("no nbwatch Monitor has started in this kernel; start one with "
                  "mon.start(...), mon.run(train) or a loop's mon.log(...), or pass a run "
                  "folder: %nbwatch runs/exp1")
            return None
        return Dashboard.for_monitor(mon)
    if args[0] in ("-h", "--help", "help"):
        print(__doc__)  # the three forms, not "--help holds no nbwatch run"
        return None
    from .store import is_run_dir

    path = Path(args[0]).expanduser()
    if args[0] in CLI_COMMANDS and not is_run_dir(path):
        _cli(args)
        return None
    if len(args) > 1:
        print(f"%nbwatch RUN_DIR takes one folder, got {line!r}; quote a path with spaces "
              "whole, or see %nbwatch --help")
        return None
    if not is_run_dir(path):
        print(f"{path} holds no nbwatch run; `%nbwatch ls` lists the runs under ./runs")
        return None
    return Dashboard.for_run(path)


# the command line's commands that act on a folder (not `demo`, which trains for minutes)
CLI_COMMANDS = ("ls", "export", "pause", "resume", "stop", "checkpoint", "recover")


def _cli(args: list[str]) -> None:
    """`nbwatch ARGS` in the cell: its lines, its errors as lines, never a SystemExit."""
    from .cli import main

    try:
        main(args)  # ls's ROOT and options (--where, --sort, --keys), export's -o, ...
    except SystemExit as e:  # a bad flag: say so here, not as a kernel-level exit
        if isinstance(e.code, str):
            print(e.code)
        elif e.code:
            usage = ("ls [ROOT] [--where KEY=VALUE] [--sort best] [--keys K,...]"
                     if args[0] == "ls" else f"{args[0]} RUN_DIR")
            print(f"usage: %nbwatch {usage}")


def register(ipython: Any) -> None:
    """Register `%nbwatch` on an IPython shell (`%load_ext nbwatch` calls this); in Colab,
    turn on its custom widget manager, so that dashboards render."""
    enable_colab_widgets()
    ipython.register_magic_function(nbwatch_magic, magic_kind="line", magic_name="nbwatch")
