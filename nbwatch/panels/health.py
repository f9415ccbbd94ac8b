"""Health: the probe pass's Transformer-health figures over steps: attention entropy and
largest attention logit per module, the residual stream's RMS per block, and the output
log-partition with the largest |logit|, beside the same two figures of every training
step's batch (`train_logits/*`); and, where the probe could not take a figure on this
model, its `probe` event's words (why, and the line to add) in that figure's place."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..alerts.health import ENTROPY, MAX_LOGIT, RMS, per_head
from ..probes.logit_rows import LOG_Z, MAX_ABS
from ._common import Series, trace


def build(series: Series, events: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """{"entropy" | "max_logit" | "rms": {name: {x, y}}, "z", "max_abs", "train_z",
    "train_max_abs": {x, y}}, per module (not per head: the attention panel's overview shows
    heads), "train_*" the training batch's every step; "notes": {"logits" | "probe":
    message} of the probe events among `events` ("probe": the probe is off)."""
    out: dict[str, Any] = {}
    for part, prefix in (("entropy", ENTROPY), ("max_logit", MAX_LOGIT), ("rms", RMS)):
        got = {k[len(prefix):]: trace(series, k) for k in series
               if k.startswith(prefix) and not per_head(k)}
        if got:
            out[part] = got
    for part, key in (("z", "logits/z_mean"), ("max_abs", "logits/max_abs"),
                      ("train_z", LOG_Z), ("train_max_abs", MAX_ABS)):
        if (t := trace(series, key)) is not None:
            out[part] = t
    notes = {str((e.get("data") or {}).get("missing") or "probe"): str(e["message"])
             for e in events if e.get("kind") == "probe"}
    if notes:
        out["notes"] = notes
    return out
