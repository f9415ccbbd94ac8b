"""Preflight: a short trial run before a long one, on the real model, restored afterwards.

`mon.preflight(step_fn, data, steps=200)` trains for a few steps through the same
runner, probes and rules as a real run (into a temporary folder), puts the model,
optimizer, scheduler, scaler and RNGs back as they were, and returns a table of checks:
pass / warn / fail, each with a one-line reason. `.ok` is False when any check fails.
"""

from __future__ import annotations

import copy
import html
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .. import controls as ctl
from ..alerts.engine import AlertEngine
from ..checkpoint import (
    Checkpointer,
    bare_module,
    load_model_state,
    model_state,
    rng_state,
    set_rng_state,
)
from ..recorder import Progress, RunSpec, StepRecorder
from ..run import Run
from ..runner import Runner
from ..store import RunStore


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "pass" | "warn" | "fail"
    reason: str


class Preflight:
    """The checks of a trial run; `.ok`, `.table`, and a small table in a notebook."""

    def __init__(self, checks: list[Check], df: pd.DataFrame, events: pd.DataFrame):
        self.checks, self.df, self.events = checks, df, events

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    @property
    def table(self) -> pd.DataFrame:
        return pd.DataFrame([c.__dict__ for c in self.checks])

    def __getitem__(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def __repr__(self) -> str:
        lines = [f"preflight {'OK' if self.ok else 'FAILED'}"]
        lines += [f"  {c.status:4s}  {c.name:14s} {c.reason}" for c in self.checks]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        colour = {"pass": "#2e7d32", "warn": "#ef6c00", "fail": "#c62828"}
        rows = "".join(
            f"<tr><td style='color:{colour[c.status]};font-weight:bold'>{c.status}</td>"
            f"<td>{html.escape(c.name)}</td><td style='text-align:left'>"
            f"{html.escape(c.reason)}</td></tr>" for c in self.checks)
        head = "preflight passed" if self.ok else "preflight FAILED"
        return f"<b>{head}</b><table>{rows}</table>"


def evaluate(df: pd.DataFrame, events: pd.DataFrame, has_scheduler: bool,
             peak_gb: float | None) -> list[Check]:
    """The checks, as a pure function of the trial's frame and events."""
    checks: list[Check] = []
    loss = df.get("loss/train", pd.Series(dtype=float))
    n = len(loss)
    if n == 0:
        return [Check("ran", "fail", "no step completed")]
    if not np.isfinite(loss).all():
        first = int(loss.index[~np.isfinite(loss.to_numpy())][0])
        checks.append(Check("loss falls", "fail", f"loss became non-finite at step {first}: "
                            "lower the LR, enable clipping, or check the data"))
    else:
        k = max(n // 5, 1)
        a, b = loss.iloc[:k].mean(), loss.iloc[-k:].mean()
        change = (b - a) / max(abs(a), 1e-12)
        if change < -0.01:
            checks.append(Check("loss falls", "pass", f"{a:.4g} → {b:.4g} ({change:+.1%})"))
        elif change < 0.01:
            checks.append(Check("loss falls", "fail" if change >= 0 else "warn",
                                f"loss flat: {a:.4g} → {b:.4g} ({change:+.1%}); "
                                "is the model learning? check the LR and that gradients flow"))
        else:
            checks.append(Check("loss falls", "fail", f"loss rose {a:.4g} → {b:.4g} "
                                f"({change:+.1%}): the LR is likely too high"))
    g = df.get("grad_norm/global", pd.Series(dtype=float)).to_numpy()
    gf = g[np.isfinite(g)]
    if len(gf) < len(g):
        checks.append(Check("grad norm", "fail", "non-finite gradient norms"))
    elif gf.max(initial=0.0) == 0.0:
        checks.append(Check("grad norm", "fail", "all gradients are zero: the loss does not "
                            "depend on the parameters (detached, or multiplied by zero)"))
    elif np.median(gf) < 1e-7:
        checks.append(Check("grad norm", "warn", f"median gradient norm {np.median(gf):.2g} "
                            "is vanishingly small"))
    elif np.median(gf) > 1e3:
        checks.append(Check("grad norm", "warn", f"median gradient norm {np.median(gf):.3g} "
                            "is large: consider clipping"))
    else:
        checks.append(Check("grad norm", "pass",
                            f"median {np.median(gf):.3g}, max {gf.max():.3g}"))
    lr = df.get("lr", pd.Series(dtype=float)).dropna()
    moved = len(lr) > 1 and not np.allclose(lr.iloc[0], lr.to_numpy())
    if has_scheduler and not moved:
        checks.append(Check("LR schedule", "warn", f"the scheduler kept the LR at "
                            f"{lr.iloc[0]:.3g} for {len(lr)} steps"))
    else:
        checks.append(Check("LR schedule", "pass",
                            f"{lr.iloc[0]:.3g} → {lr.iloc[-1]:.3g}" if moved
                            else f"constant {lr.iloc[0]:.3g} (no scheduler)"))
    tps = df.get("throughput/tokens_per_s")
    step_s = df["time/step"].median() if "time/step" in df else math.nan
    share = (df["time/data"].sum() / df["time/step"].sum()) if "time/data" in df else 0.0
    rate = f"{tps.median():,.0f} tokens/s, " if tps is not None else ""
    checks.append(Check("throughput", "warn" if share > 0.3 else "pass",
                        f"{rate}{step_s * 1e3:.1f} ms/step, {share:.0%} waiting for data"))
    if peak_gb is not None:
        checks.append(Check("peak memory", "pass", f"{peak_gb:.2f} GB"))
    if "data/padding_ratio" in df:
        pad = float(df["data/padding_ratio"].mean())
        checks.append(Check("padding", "warn" if pad > 0.5 else "pass",
                            f"{pad:.0%} of tokens are padding"))
    alerts = events[events.kind == "alert"] if len(events) else events
    if len(alerts):
        worst = "fail" if (alerts.severity == "critical").any() else (
            "warn" if (alerts.severity == "warning").any() else "pass")
        checks.append(Check("no alert", worst, "; ".join(alerts.message.head(3))))
    else:
        checks.append(Check("no alert", "pass", "no alert fired"))
    return checks


def _on_host(obj: Any) -> Any:
    """A copy of a state dict with its tensors in host memory: a copy on the GPU would hold
    the weights and the optimizer's moments twice through the trial (a model that trains
    in the GPU's memory could fail there) and count them in its peak memory."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _on_host(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_on_host(v) for v in obj)
    return copy.deepcopy(obj)


def preflight(mon: Any, step_fn: Any, data: Any, steps: int = 200, **kw: Any) -> Preflight:
    """Trial-run `steps` steps on `mon`'s model, optimizer and scheduler, then restore them."""
    import torch

    saved = {  # in host memory (`_on_host`), a PEFT model's frozen base left as it is
        "model": _on_host(model_state(bare_module(mon.model))),
        "optimizer": _on_host(mon.optimizer.state_dict()),
        "scheduler": copy.deepcopy(mon.scheduler.state_dict()) if mon.scheduler else None,
        "scaler": copy.deepcopy(mon.scaler.state_dict()) if mon.scaler else None,
        "rng": rng_state(),
        "training": mon.model.training,
    }
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    kw.setdefault("hist_every", max(steps // 4, 1))
    spec = RunSpec(step_fn, data, steps, trial=True, **kw)
    with tempfile.TemporaryDirectory(prefix="nbwatch-preflight-") as tmp:
        store = RunStore(Path(tmp) / "run")
        rules = [r for r in mon.rules if "pause" not in r.actions or r.name == "nonfinite"]
        engine = AlertEngine(rules)
        progress = Progress()
        control = ctl.ControlState()
        control.clip = mon.control.clip
        rec = StepRecorder(spec, mon.model, mon.optimizer, mon.scheduler, mon.scaler, store,
                           Checkpointer(Path(tmp) / "checkpoints"), ctl.CommandQueue(), control,
                           progress, 0, engine)
        mon._session.recorder = rec  # the Monitor's optimizer hooks measure the trial's steps
        try:
            mon.model.train()
            Runner(spec, rec).run()
        finally:
            mon._session.recorder = None
            store.close()
            load_model_state(bare_module(mon.model), saved["model"])
            mon.optimizer.load_state_dict(saved["optimizer"])
            if mon.scheduler is not None:
                mon.scheduler.load_state_dict(saved["scheduler"])
            if mon.scaler is not None:
                mon.scaler.load_state_dict(saved["scaler"])
            set_rng_state(saved["rng"])
            mon.model.train(saved["training"])
        run = Run(Path(tmp) / "run")
        df, events = run.df, run.events
        run.reader.close()
    if progress.error is not None:
        checks = [Check("ran", "fail", f"the step raised {type(progress.error).__name__}: "
                        f"{progress.error}")]
        return Preflight(checks, df, events)
    peak = None
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
    elif "system/proc/rss_gb" in df:
        peak = float(df["system/proc/rss_gb"].max())
    else:
        import psutil

        peak = psutil.Process().memory_info().rss / 2**30
    return Preflight(evaluate(df, events, mon.scheduler is not None, peak), df, events)

