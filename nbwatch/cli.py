"""Command line: `nbwatch demo`, `nbwatch ls [ROOT]`, `nbwatch export RUN_DIR -o run.html`."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from .liveness import STALE_AFTER
from .text import duration


def _demo(args: argparse.Namespace) -> int:
    from .demo import make_demo
    from .monitor import Monitor
    from .run import open_run

    demo = make_demo(max_steps=args.steps)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / time.strftime(
        "demo-%Y%m%d-%H%M%S")
    mon = Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=run_dir,
                  config=demo.config, name=run_dir.name)
    print(f"nbwatch demo: TinyGPT on Python's own source, {args.steps} steps -> {run_dir}")
    mon.start(max_steps=args.steps, eval_every=args.eval_every, display=False,
              **demo.start_kwargs())
    last, alerts_seen = -1, 0
    while mon.running:
        time.sleep(args.print_every)
        ev = mon.events
        alerts = ev[(ev.kind == "alert") & (ev.severity != "info")]
        for _, a in alerts.iloc[alerts_seen:].iterrows():
            print(f"  {a.severity} at step {a.step}: {a.message}", flush=True)
        alerts_seen = len(alerts)
        df = mon.df
        if "loss/train" not in df or mon.step == last:  # only system figures so far
            continue
        last = mon.step
        row = df.iloc[-20:].mean(numeric_only=True)
        vals = df["loss/val"].dropna() if "loss/val" in df else ()
        val = f"val {vals.iloc[-1]:.3f}" if len(vals) else "val –    "  # before the first eval
        print(f"step {mon.step:5d}/{args.steps}  loss {row['loss/train']:.3f}  "
              f"{val}  lr {row['lr']:.2e}  grad {row['grad_norm/global']:.2f}  "
              f"{row.get('throughput/tokens_per_s', math.nan):,.0f} tok/s", flush=True)
    mon.wait()
    df = mon.df
    first = df["loss/train"].iloc[:20].mean()
    final = df["loss/train"].iloc[-20:].mean()
    print(f"done: {mon.state} at step {mon.step}; train loss {first:.3f} -> {final:.3f}")
    samples = open_run(run_dir).samples
    if not samples.empty:
        print(f"sample at step {samples.step.iloc[-1]}: {samples.text.iloc[-1]!r}")
    print(f"run folder: {run_dir}  (nbwatch.open_run({str(run_dir)!r}))")
    report = mon.export_html(run_dir / "report.html")
    print(f"snapshot: {report}  ({report.stat().st_size / 2**20:.1f} MB, opens offline)")
    return 0


def _export(args: argparse.Namespace) -> int:
    from .export import export_html
    from .store import is_run_dir

    run_dir = Path(args.run_dir)
    if not is_run_dir(run_dir):
        print(f"{run_dir} holds no nbwatch run; `nbwatch ls` lists the runs under ./runs")
        return 1
    out = Path(args.output) if args.output else run_dir / "report.html"
    t0 = time.perf_counter()
    out = export_html(run_dir, out, environment=not args.no_environment)
    print(f"{out}  ({out.stat().st_size / 2**20:.1f} MB in {time.perf_counter() - t0:.1f} s)")
    return 0


def _parse_where(items: list[str]) -> dict[str, Any]:
    where: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
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
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def _ls(args: argparse.Namespace) -> int:
    import warnings

    from .compare import LS_COLUMNS, list_runs

    where = _parse_where(args.where)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs = list_runs(args.root, where, args.sort,
                             args.keys.split(",") if args.keys else None, args.max_keys,
                             args.stale_after)
    except FileNotFoundError as e:
        print(e)
        return 1
    for w in caught:
        print(w.message, file=sys.stderr)
    if runs.empty:
        print(f"no nbwatch runs under {args.root}" + (f" matching {where}" if where else ""))
        return 0
    keys = [c for c in runs.columns if c not in LS_COLUMNS]
    width = max(len("run"), *(len(r) for r in runs["run"]))
    print(f"{'run':{width}s}  {'state':9s} {'steps':>13s} {'best val':>9s} {'@step':>7s} "
          f"{'last train':>10s} {'wall':>6s}  config")
    for r in runs.to_dict("records"):
        r = {k: _plain(v) for k, v in r.items()}  # pandas' NaN for a missing value, 3.0 for 3
        steps = f"{r['steps']}/{r['max_steps']}" if r["max_steps"] else str(r["steps"])
        cfg = "  ".join(f"{k}={r[k]!r}" if isinstance(r[k], str) else f"{k}={r[k]}"
                        for k in keys if r[k] is not None)
        print(f"{r['run']:{width}s}  {r['state']:9s} {steps:>13s} {_fmt(r['best_val'], '9.4f')} "
              f"{_fmt(r['best_val_step'], '7d')} {_fmt(r['last_train'], '10.4f')} "
              f"{duration(r['wall_s']):>6s}  {cfg}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nbwatch", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a tiny GPT on Python's own source, monitored")
    d.add_argument("--steps", type=int, default=1000)
    d.add_argument("--eval-every", type=int, default=100)
    d.add_argument("--run-dir", default=None)
    d.add_argument("--print-every", type=float, default=5.0)
    d.set_defaults(fn=_demo)
    ls = sub.add_parser("ls", help="list the runs under a folder: state, steps, best val "
                        "loss, config")
    ls.add_argument("root", nargs="?", default="runs")
    ls.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                    help="keep runs whose config has KEY equal to VALUE (JSON or a string)")
    ls.add_argument("--sort", choices=("name", "best", "steps"), default="name")
    ls.add_argument("--keys", default=None,
                    help="comma-separated config keys to show (default: those that differ)")
    ls.add_argument("--max-keys", type=int, default=6)
    ls.add_argument("--stale-after", type=float, default=STALE_AFTER,
                    help="call a 'running' run stale after this many seconds without a write")
    ls.set_defaults(fn=_ls)
    ex = sub.add_parser("export", help="write a run as one self-contained HTML file")
    ex.add_argument("run_dir")
    ex.add_argument("-o", "--output", default=None,
                    help="the HTML file to write (default: RUN_DIR/report.html)")
    ex.add_argument("--no-environment", action="store_true",
                    help="leave out host, pid, working directory, command line and versions")
    ex.set_defaults(fn=_export)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
