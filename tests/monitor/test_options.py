"""The one table of options (`nbwatch.monitor.options.Options`): `Monitor(...)` takes every one
with the table's default, `start()` overrides any of them for one run, and an option left
out of `start()` is "not given" (a sentinel), so that None given is a value."""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields

import nbwatch
from nbwatch.monitor.options import NOT_GIVEN, Options
from tests.conftest import make_batches, tiny_step


def test_monitor_takes_every_option_with_the_tables_default():
    params = inspect.signature(nbwatch.Monitor.__init__).parameters
    for f in fields(Options):
        assert f.name in params, f"Monitor(...) lacks the option {f.name}"
        assert f.default is not MISSING and params[f.name].default == f.default, f.name


def test_start_overrides_options_of_the_table_and_defaults_to_not_given():
    params = inspect.signature(nbwatch.Monitor.start).parameters
    names = {f.name for f in fields(Options)}
    run_only = {"self", "step_fn", "train_data", "max_steps", "val_fn", "eval_every",
                "sample_fn", "resume", "accumulate", "dry_run"}
    for name, p in params.items():
        if name in run_only:
            continue
        assert name in names, f"start({name}=) is not an option of the table"
        assert p.default is NOT_GIVEN, f"start({name}=) must default to NOT_GIVEN"


def test_start_clip_none_turns_off_the_monitors_clip(tiny, tmp_path):
    """`start(clip=None)` used to read as "not given": a `Monitor(clip=1e-3)` clipped anyway."""
    model, opt, _ = tiny
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", clip=1e-3)
    mon.start(tiny_step, make_batches(), max_steps=5, clip=None, display=False).wait()
    df = mon.df
    assert (df["grad_norm/clipped"] == df["grad_norm/global"]).all(), df[
        ["grad_norm/global", "grad_norm/clipped"]]
    mon2 = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r2", clip=1e-3)
    mon2.start(tiny_step, make_batches(), max_steps=5, display=False).wait()
    assert (mon2.df["grad_norm/clipped"] <= 1e-3 * 1.001).all()  # left out: the Monitor's
