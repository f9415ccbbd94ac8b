"""Command line: `nbwatch demo`, `nbwatch ls [ROOT]`, `nbwatch export RUN_DIR -o run.html`,
`nbwatch pause|resume|stop|checkpoint RUN_DIR` (a run another process trains).

A mistake of the user's (a bad argument, a missing or damaged run, a refused output path)
is one line on stderr and a nonzero exit status (2 for what argparse rejects), never a
traceback; set NBWATCH_TRACEBACK=1 to see one. Every line it prints shows control characters
as escapes (`\\x1b`, `\\n`): a run folder's name and meta may come from someone else. Nothing
heavy (torch, pandas) is imported until a subcommand runs, so `nbwatch --help` and
`nbwatch --version` answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sqlite3
import stat
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from .text import duration

MISSING = "–"  # a value a run does not have, in every column (the same as `duration`'s)
# C0 and C1 controls, DEL and the bidirectional overrides (a terminal acts on them), and the
# lone surrogates that stand for a file name's undecodable bytes (no stream can encode them)
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


class UserError(Exception):
    """A mistake the user can fix: printed as one line, exit status 1."""


def visible(text: object) -> str:
    """`text` with its control characters written as escapes (`\\x1b`, `\\n`): a run folder's
    name, meta or error (which may come from someone else) cannot clear the screen, write
    the clipboard (OSC 52) or break a table row."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


def say(text: object, err: bool = False) -> None:
    """Print one line of the CLI's, its control characters visible."""
    print(visible(text), file=sys.stderr if err else sys.stdout, flush=True)


class _Lines(logging.Handler):
    """nbwatch's log warnings while a command runs: one visible line each on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        say(record.getMessage(), err=True)


@contextlib.contextmanager
def _warnings_said() -> Iterator[None]:
    """Warnings and nbwatch's log warnings raised inside, each one line on stderr (not
    Python's two-line form with a source line, nor raw)."""
    logger, handler = logging.getLogger("nbwatch"), _Lines(logging.WARNING)
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        logger.removeHandler(handler)
        for w in caught:
            say(w.message, err=True)


def _demo(args: argparse.Namespace) -> int:
    from .demo import make_demo
    from .monitor import Monitor
    from .run import open_run
    from .store import is_run_dir

    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / time.strftime(
        "demo-%Y%m%d-%H%M%S")
    if is_run_dir(run_dir):
        raise UserError(f"{run_dir} already holds a run; pass a new --run-dir (or leave it "
                        "out for runs/demo-<time>)")
    demo = make_demo(max_steps=args.steps)
    mon = Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=run_dir,
                  config=demo.config, name=run_dir.name)
    say(f"nbwatch demo: TinyGPT on Python's own source, {args.steps} steps -> {run_dir}")
    mon.start(max_steps=args.steps, eval_every=args.eval_every, display=False,
              **demo.start_kwargs())
    try:
        _follow(mon, args)
    except KeyboardInterrupt:
        mon.stop()
        mon.wait()
        say(f"interrupted: stopped at step {mon.step}; run folder: {run_dir}", err=True)
        return 130
    try:
        mon.wait()
    except Exception as e:  # noqa: BLE001 - the training's own error: one line, then where
        raise UserError(f"training failed at step {mon.step}: {_first_line(e)} (the "
                        f"traceback is in {run_dir / 'log.jsonl'})") from e
    df = mon.df
    first = df["loss/train"].iloc[:20].mean()
    final = df["loss/train"].iloc[-20:].mean()
    say(f"done: {mon.state} at step {mon.step}; train loss {first:.3f} -> {final:.3f}")
    samples = open_run(run_dir).samples
    if not samples.empty:
        say(f"sample at step {samples.step.iloc[-1]}: {samples.text.iloc[-1]!r}")
    say(f"run folder: {run_dir}  (nbwatch.open_run({str(run_dir)!r}))")
    report = mon.export_html(run_dir / "report.html")
    say(f"snapshot: {report}  ({report.stat().st_size / 2**20:.1f} MB, opens offline)")
    return 0


def _follow(mon: Any, args: argparse.Namespace) -> None:
    """Progress lines and alerts while the demo trains. Each line reads only the events
    since the last and the last 20 steps' figures: the whole frame, read every second,
    would cost the training thread more as the run grows."""
    from .store import RunReader, is_run_dir

    last, event_id, reader, paused, said_means = -1, 0, None, False, False
    keys = ["loss/train", "lr", "grad_norm/global", "throughput/tokens_per_s"]
    while mon.running:
        time.sleep(args.print_every)
        if (mon.state == "paused") != paused:
            paused = not paused
            say(f"paused at step {mon.step}" if paused else f"resumed at step {mon.step}")
        if reader is None:
            if not is_run_dir(mon.run_dir):
                continue
            reader = RunReader(mon.run_dir)
        for e in reader.events_since(event_id):
            event_id = e["id"]
            if e["kind"] == "alert" and e["severity"] != "info":
                say(f"  {e['severity']} at step {e['step']}: {e['message']}")
        step = reader.last_step()
        if step <= 0 or step == last:
            continue
        last = step
        df = reader.scalars(keys, max(step - 19, 1), step + 1)
        if "loss/train" not in df:  # only system figures so far
            continue
        val = reader.last_value("loss/val")
        if not said_means:
            said_means = True
            say("(loss, grad and tok/s: means of the last 20 steps; lr: the newest step's)")
        row = df.mean(numeric_only=True)
        lr = df["lr"].dropna().iloc[-1] if "lr" in df and df["lr"].notna().any() else math.nan
        shown = f"val {val:.3f}" if val is not None else f"val {MISSING:5s}"  # before an eval
        say(f"step {step:5d}/{args.steps}  loss {row['loss/train']:.3f}  "
            f"{shown}  lr {lr:.2e}  "
            f"grad {row.get('grad_norm/global', math.nan):.2f}  "
            f"{row.get('throughput/tokens_per_s', math.nan):,.0f} tok/s")
    if reader is not None:
        reader.close()


def _export(args: argparse.Namespace) -> int:
    from .export import export_html
    from .store import is_run_dir

    run_dir = Path(args.run_dir)
    if not is_run_dir(run_dir):
        raise UserError(f"{run_dir} holds no nbwatch run; `nbwatch ls` lists the runs under "
                        "./runs")
    out = _output(run_dir, args.output)
    t0 = time.perf_counter()
    with _warnings_said():
        out = export_html(run_dir, out, environment=not args.no_environment)
    seconds = time.perf_counter() - t0
    try:
        st = out.stat()
    except OSError:  # a pipe's /proc link, gone with its reader
        st = None
    size = f"{st.st_size / 2**20:.1f} MB in " if st and stat.S_ISREG(st.st_mode) else ""
    # the page went to stdout (-o /dev/stdout): the line must not land after it
    say(f"{out}  ({size}{seconds:.1f} s)", err=_is_stdout(st))
    return 0


STEER = {"pause": "pause after the current step (the run waits for a resume or a stop)",
         "resume": "resume a paused run",
         "stop": "stop after the current step, with a final checkpoint",
         "checkpoint": "write a checkpoint after the current step"}


def _steer(args: argparse.Namespace) -> int:
    """Send a command to a live run (another process's: a script, torchrun's rank 0) and
    wait for its outcome: 0 applied, 1 refused, expired or not heard within --wait."""
    from .attached import attach
    from .store import is_run_dir

    run_dir = Path(args.run_dir)
    if not is_run_dir(run_dir):
        raise UserError(f"{run_dir} holds no nbwatch run; `nbwatch ls` lists the runs under "
                        "./runs")
    run = attach(run_dir, display=False)
    try:
        cid = getattr(run, args.cmd)()
        facts = run.meta.get("run") or {}
        ranks, every = facts.get("world_size") or 1, (facts.get("options") or {}).get(
            "rank_every")
        if ranks > 1 and every and run.state in ("running", "paused"):
            say(f"{run_dir.name}: {args.cmd} sent; its {ranks} ranks take it together at "
                f"their next meeting (every {every} steps at most, or about 2 s) ...")
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline:
            for kind, msg, data in zip(*(run.events[c] for c in ("kind", "message", "data"))):
                if isinstance(data, dict) and data.get("id") == cid:
                    refused = kind == "command"  # applied: "action" ("checkpoint": its own)
                    say(f"{run_dir.name}: {msg}", err=refused)
                    return 1 if refused else 0
            time.sleep(0.2)
        where = f"{run.state} at step {run.step}"
    finally:
        run.close()
    raise UserError(f"{args.cmd} sent to {run_dir.name} ({where}), with no answer in "
                    f"{args.wait:g} s: it is taken at the run's next step boundary (a long "
                    "step, or an eval, keeps it waiting)")


def _is_stdout(st: os.stat_result | None) -> bool:
    """Whether `st` (of the file an export wrote) is that of this process's stdout."""
    try:
        own = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (a notebook's)
        return False
    return st is not None and (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _output(run_dir: Path, output: str | None) -> Path:
    """`-o`: a file, or a folder (one that exists, or any path ending in a separator, which
    is created) to write `<run folder name>.html` in; RUN_DIR/report.html by default."""
    if not output:
        return run_dir / "report.html"
    seps = tuple(s for s in (os.sep, os.altsep, "/") if s)
    out = Path(output)
    if output.endswith(seps) or out.is_dir():
        if out.exists() and not out.is_dir():
            raise UserError(f"-o {output}: {out} is a file, not a folder; drop the trailing "
                            f"{output[-1]} to replace it, or name a folder")
        if out.absolute().resolve() == run_dir.absolute().resolve():
            return out / "report.html"
        return out / f"{run_dir.absolute().resolve().name or 'run'}.html"
    return out


def _parse_where(items: list[str]) -> dict[str, Any]:
    where: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            # SystemExit: one line on stderr, status 1; `%nbwatch ls` prints it in the cell
            raise SystemExit(f"--where takes KEY=VALUE (e.g. --where lr=3e-4), got {item!r}")
        try:
            where[key] = json.loads(raw)
        except json.JSONDecodeError:
            where[key] = raw  # a bare string: --where optimizer=adamw
    return where


def _plain(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v):
            return None
        if v.is_integer() and abs(v) < 2**53:
            return int(v)
    return v


def _fmt(v: Any, spec: str) -> str:
    """`v` formatted by `spec` ('9.4f'); a missing value as MISSING in the same width."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        width = "".join(c for c in spec.split(".")[0] if c.isdigit())
        return format(MISSING, f">{width}") if width else MISSING
    return format(v, spec)


def _first_line(e: BaseException | str, limit: int = 200) -> str:
    lines = str(e).strip().splitlines()
    line = lines[0] if lines else type(e).__name__
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _ls(args: argparse.Namespace) -> int:
    from .comparison import LS_COLUMNS, list_runs
    from .store.liveness import STALE_AFTER

    where = _parse_where(args.where)
    stale_after = STALE_AFTER if args.stale_after is None else args.stale_after
    with _warnings_said():
        runs = list_runs(args.root, where, args.sort,
                         args.keys.split(",") if args.keys else None, args.max_keys,
                         stale_after)
    if runs.empty:
        say(f"no nbwatch runs under {args.root}" + (f" matching {where}" if where else ""))
        return 0
    keys = [c for c in runs.columns if c not in LS_COLUMNS]
    runs["run"] = runs["run"].map(visible)  # as printed: a name's escapes widen its column
    width = max(len("run"), *(len(r) for r in runs["run"]))
    say(f"{'run':{width}s}  {'state':9s} {'steps':>13s} {'best val':>9s} {'@step':>7s} "
        f"{'last train':>10s} {'wall':>6s}  config")
    for r in runs.to_dict("records"):
        r = {k: _plain(v) for k, v in r.items()}  # pandas' NaN for a missing value, 3.0 for 3
        steps = f"{r['steps']}/{r['max_steps']}" if r["max_steps"] else str(r["steps"])
        cfg = "  ".join(f"{k}={r[k]!r}" if isinstance(r[k], str) else f"{k}={r[k]}"
                        for k in keys if r[k] is not None)
        why = f"  ({_first_line(r['error'], 120)})" if r.get("error") else ""
        say(f"{r['run']:{width}s}  {r['state']:9s} {steps:>13s} {_fmt(r['best_val'], '9.4f')} "
            f"{_fmt(r['best_val_step'], '7d')} {_fmt(r['last_train'], '10.4f')} "
            f"{duration(r['wall_s']):>6s}  {cfg}{why}".rstrip())
    return 0


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not v > 0 or (kind is float and not math.isfinite(v)):
            what = "a positive integer" if kind is int else "a positive number of seconds"
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return v
    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nbwatch")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        from ._version import __version__

        return __version__


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (with where to look) rather than two."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, visible(f"{self.prog}: error: {message} (see `{self.prog} --help`)") + "\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nbwatch", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"nbwatch {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True,
                           metavar="{demo,ls,export,pause,resume,stop,checkpoint,recover}")
    d = sub.add_parser("demo", help="train a tiny GPT on Python's own source, monitored",
                       description="Train a small GPT on the characters of Python's own "
                       "standard library, monitored: progress lines here, the run folder "
                       "and an HTML snapshot at the end.")
    d.add_argument("--steps", type=_positive(int), default=1000, metavar="N",
                   help="optimizer steps to train (default: %(default)s)")
    d.add_argument("--eval-every", type=_positive(int), default=100, metavar="N",
                   help="steps between evaluations: val loss, a text sample, attention "
                   "maps (default: %(default)s)")
    d.add_argument("--run-dir", default=None, metavar="DIR",
                   help="the run folder to create (default: runs/demo-YYYYMMDD-HHMMSS)")
    d.add_argument("--print-every", type=_positive(float), default=5.0, metavar="SECONDS",
                   help="seconds between progress lines (default: %(default)s)")
    d.set_defaults(fn=_demo)
    ls = sub.add_parser("ls", help="list the runs under a folder: state, steps, best val "
                        "loss, config")
    ls.add_argument("root", nargs="?", default="runs",
                    help="the folder searched for runs (default: %(default)s)")
    ls.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                    help="keep runs whose config has KEY equal to VALUE (JSON or a string)")
    ls.add_argument("--sort", choices=("name", "best", "steps"), default="name",
                    help="order: run name, best val loss, or most steps first "
                    "(default: %(default)s)")
    ls.add_argument("--keys", default=None,
                    help="comma-separated config keys to show (default: those that differ)")
    ls.add_argument("--max-keys", type=_positive(int), default=6, metavar="N",
                    help="show at most N config keys (default: %(default)s)")
    ls.add_argument("--stale-after", type=_positive(float), default=None, metavar="SECONDS",
                    help="call a 'running' run stale after this many seconds without a write"
                    " (default: 30)")
    ls.set_defaults(fn=_ls)
    ex = sub.add_parser("export", help="write a run as one self-contained HTML file")
    ex.add_argument("run_dir", help="the run folder")
    ex.add_argument("-o", "--output", default=None, metavar="PATH",
                    help="the HTML file to write; a folder (an existing one, or a path ending"
                    " in /, created) gets RUN.html, RUN being the run folder's name "
                    "(default: RUN_DIR/report.html)")
    ex.add_argument("--no-environment", action="store_true",
                    help="leave out host, pid, working directory, command line and versions")
    ex.set_defaults(fn=_export)
    for name, what in STEER.items():
        c = sub.add_parser(name, help=f"{what} (a run another process trains)")
        c.add_argument("run_dir", help="the run folder")
        c.add_argument("--wait", type=_positive(float), default=10.0, metavar="SECONDS",
                       help="how long to wait for the run to answer (default: %(default)s)")
        c.set_defaults(fn=_steer)
    rc = sub.add_parser("recover", help="make a run folder a killed writer left one readable "
                        "file again, and check it")
    rc.add_argument("run_dir", help="the run folder")
    rc.set_defaults(fn=_recover)
    return p


def _recover(args: argparse.Namespace) -> int:
    from .store.recover import main as recover_main

    return recover_main([args.run_dir])


# What a user can fix: the message says what and how. Anything else is a bug: a traceback.
USER_ERRORS = (UserError, ValueError, OSError, RuntimeError, sqlite3.Error)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        say(f"nbwatch {args.cmd}: interrupted", err=True)
        return 130
    except BrokenPipeError:  # `nbwatch ls | head`: the reader is done, nothing failed
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 141
    except USER_ERRORS as e:
        if os.environ.get("NBWATCH_TRACEBACK"):
            raise
        msg = _first_line(e, 1000)
        if isinstance(e, sqlite3.Error):  # past the store's own checks: a damaged file
            where = Path(getattr(args, "run_dir", None) or "a run") / "nbwatch.db"
            msg = (f"{where} cannot be read ({msg}): the file is damaged; its run's "
                   "checkpoints/ folder, if any, still holds the weights")
        say(f"nbwatch {args.cmd}: {msg}", err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
