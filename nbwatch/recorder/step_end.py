"""The end of an optimizer step: its record. Timings, derived figures (padding ratio,
throughput), the "step" rules, the `Scalars` row, weight and sequence-length histograms;
on a GPU the step's device figures wait to be copied with the next step's gradients.

    scheduler.step()
    end of the step   LR factor on · the step's record · "step" rules · histograms
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from .. import controls as ctl
from ..alerts import weight_std
from ..distributed import rank_figures
from ..probes import weights as wprobe
from ..probes.data import bad_mask
from ..probes.throughput import add_rates, timing_figures
from ..records import Event, Histogram, Scalars
from .optimizer_step import to_host
from .spec import SMOOTHING

_FROM_ALL_RANKS = ("loss/train", "tokens/real", "throughput/tokens_per_s")


@dataclass
class _Deferred:
    """Device figures of a step, copied to the host with the next gradient copy."""

    step: int
    names: list[str]
    parts: list[torch.Tensor]
    values: dict[str, float]  # host figures of that step, completed by the copy
    alerts: list


class StepEnd:
    """Part of `StepRecorder` (its state is set in `StepRecorder.__init__`)."""

    def end_step(self, values: dict[str, float], names: list[str] | None = None,
                 parts: list[torch.Tensor] | None = None, *, data_s: float | None = None,
                 samples: int | None = None, extra_times: dict[str, float] | None = None
                 ) -> int:
        """Close the optimizer step just taken: its record (host `values`, plus device
        `parts` named `names`), timings, histograms. Returns the step number."""
        t_end = time.perf_counter()
        t = self._taking
        self._taking, self._stepped = None, False
        self.lr.on(only_if_scheduled=True)
        step = self.step + 1
        if t is None:  # a GradScaler found inf/NaN gradients and skipped the optimizer
            self.flush_deferred()  # steps are recorded in order
            values = {**values, "amp/overflow": 1.0}
            if self.lr.repair_after_overflow():
                values["lr"] = ctl.lrs(self.opt)[0]
            alerts: list = []
            if self._staged is not None:  # the runner's loss, never copied: copy it now
                names, parts = self._staged[0] + (names or []), self._staged[1] + (parts or [])
                self._staged = None
        else:
            values = {**t.values, **values}
            alerts = t.alerts
            values["time/probes"] = t.t_probe - t.t_pre
            values["time/optimizer"] = t.t_post - t.t_probe
        # data_s None: a loop of the user's, whose data wait nbwatch does not see
        values.update(timing_figures(t_end - self._t_boundary, data_s))
        if samples:
            values["_samples"] = float(samples)  # its rate: with tokens/s, once on the host
        if extra_times:
            values.update(extra_times)
        self.step = step
        self.progress.step = step
        self.batch_ids.end_step(step)
        if parts:
            on_gpu = parts[0].device.type == "cuda" and t is not None
            if on_gpu and self.dist is None:
                self._deferred = _Deferred(step, list(names), list(parts), values, alerts)
            else:
                values.update(zip(names, to_host(parts)))
                self._complete(step, values, alerts, t is None)
        else:
            self._complete(step, values, alerts, t is None)
        if t is not None and t.before is not None:
            self._histograms(step)
        if self.scaler is not None and isinstance(getattr(self.scaler, "_scale", None),
                                                  torch.Tensor):
            self._scale_ref = self.scaler._scale.clone()  # no sync: compared on overflow only
        self.lr.end_step()
        self._t_boundary = time.perf_counter()
        return step

    def _complete(self, step: int, values: dict[str, float], alerts: list,
                  overflow: bool = False) -> None:
        """The step's figures are all on the host: derived figures, "step" rules, record."""
        bad = bad_mask(values)  # a GPU mask of other values than 0/1: its figures dropped
        if bad is not None and not self._mask_said:
            self._mask_said = True
            self._emit(Event(step, "probe", "warning", bad))
        tokens = values.get("tokens/real")
        padded = values.pop("_padded", None)
        if tokens is not None and padded:
            values["data/padding_ratio"] = 1.0 - tokens / padded
        samples = values.pop("_samples", None)
        add_rates(values, int(samples) if samples else None)
        loss = values.get("loss/train")
        if overflow and loss is not None and not math.isfinite(loss):
            alerts = alerts + self.engine.observe("grads", step, values)  # a real NaN
        elif overflow:
            values.pop("grad_norm/global", None)
        if self.lr.scheduler_moved():
            self.engine.explain_lr()
        alerts = alerts + self.engine.observe("step", step, values)
        if self.dist is not None:
            self._rank_rows.append((step, {**rank_figures(values), "time/sync": self._sync_s}))
            self._sync_s = 0.0
            # run-level loss, tokens and throughput come from all ranks, at the next exchange
            stored = {k: v for k, v in values.items() if k not in _FROM_ALL_RANKS}
        else:
            stored = values
        self.store.put(Scalars(step, stored))
        if loss is not None and math.isfinite(loss):
            p = self.progress
            p.train_ema = SMOOTHING * p.train_ema + (1 - SMOOTHING) * loss
            p.train_ema_n += 1
        self._raise_alerts(alerts)
        every = self.spec.log_every
        if every and step % every == 0:
            self.log.info("step", extra={"step": step, "data": {
                k: values[k] for k in ("loss/train", "grad_norm/global", "lr", "time/step")
                if k in values}})

    def record_step(self, host: dict[str, float], names: list[str],
                    parts: list[torch.Tensor], *, lengths: torch.Tensor | None = None,
                    samples: int | None = None, val: Any = None,
                    reduction: str | None = None) -> int:
        """The end of an optimizer step in a loop nbwatch does not run (`Monitor.log`, the
        framework adapters): its record, its eval if `val`, a periodic checkpoint."""
        if lengths is not None:
            self.keep_seq_lens(lengths)
        self.save_reduction(reduction)
        step = self.end_step(host, names, parts, samples=samples)
        self.step_done(val=val)
        return step

    def flush_deferred(self) -> None:
        """Copy and record a step whose device figures wait for the next gradient copy."""
        d, self._deferred = self._deferred, None
        if d is not None:
            d.values.update(zip(d.names, to_host(d.parts)))
            self._complete(d.step, d.values, d.alerts)

    def save_reduction(self, reduction: str | None) -> None:
        if not self._reduction_saved and reduction:
            self.store.set_meta("loss_reduction", reduction)
            self._reduction_saved = True

    def keep_seq_lens(self, lengths: torch.Tensor) -> None:
        if self.spec.hist_every > 0:
            self._seq_lens.append(lengths)

    def _histograms(self, step: int) -> None:
        edges, counts = wprobe.layer_histograms(self.layers, self.spec.hist_bins)
        edges, counts = edges.cpu().double().numpy(), counts.cpu().numpy()
        for i, name in enumerate(self.layers.names):
            self.store.put(Histogram(step, f"weight/{name}", edges[i], counts[i]))
        stds = {n: weight_std(edges[i], counts[i]) for i, n in enumerate(self.layers.names)}
        self._raise_alerts(self.engine.observe("hist", step, weight_std=stds))
        if self._seq_lens:
            lens = torch.cat([t.float().cpu() for t in self._seq_lens])
            self._seq_lens.clear()
            hi = max(float(lens.max()), 1.0)
            e, c = wprobe.histogram(torch.cat([lens, lens.new_tensor([0.0, hi])]), 32)
            c[0] -= 1  # the two range anchors are not data: pin the range at [0, max]
            c[-1] -= 1
            self.store.put(Histogram(step, "data/seq_len", e.double().numpy(), c.numpy()))
