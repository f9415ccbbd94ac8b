"""Header: run name, state, step/max with progress and ETA, tokens/s with the achieved
TFLOP/s and MFU, the spike score, what watching costs, elapsed; red on failure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..lifecycle import is_ended, is_live
from ..text import duration

# shown as the median of the newest steps' (panels.Feed), as steps/s is over its window
RATES = ("throughput/tokens_per_s", "throughput/tflops", "throughput/mfu")


def build(
    meta: Mapping[str, Any],
    step: int,
    walls: list[tuple[int, float]],
    latest: Mapping[str, float],
    now: float,
    error: Mapping[str, Any] | None = None,
    watch: float | None = None,
) -> dict[str, Any]:
    """`walls`: (step, wall time) of recent steps, oldest first; `error`: the error event;
    `watch`: what watching took of the newest steps (`watch_share_of`)."""
    state = str(meta.get("state", "unknown"))
    max_steps = meta.get("max_steps")
    rate = None
    if len(walls) >= 2 and walls[-1][1] > walls[0][1]:
        rate = (walls[-1][0] - walls[0][0]) / (walls[-1][1] - walls[0][1])  # steps/s
    eta = None
    if max_steps and rate and state in ("running", "starting"):
        eta = max(int(max_steps) - step, 0) / rate
    elapsed = run_duration(meta, walls[-1][1] if walls else None, now)
    out: dict[str, Any] = {}
    if state == "stopped" and meta.get("stopped_by"):  # a kernel shut down, the process ended
        out["message"] = f"stopped: {meta['stopped_by']}"
    return out | {
        "name": str(meta.get("name", "")),
        "state": state,
        "ended": is_ended(state),  # the page keeps no list of states of its own
        "step": int(step),
        "max_steps": int(max_steps) if max_steps else None,
        "progress": min(step / int(max_steps), 1.0) if max_steps else None,
        "steps_per_s": rate,
        "eta_s": eta,
        "elapsed_s": elapsed,
        "elapsed": duration(elapsed),  # the page shows this text: the export's summary too
        "tokens_per_s": latest.get("throughput/tokens_per_s"),
        "tflops": latest.get("throughput/tflops"),
        "mfu": latest.get("throughput/mfu"),
        # steps that spiked among the last 10,000 (spike_score.py: OLMo-core's definition)
        "spike_score": latest.get("spike/score"),
        "watch_share": watch,
        "failed": state == "failed" or error is not None,
        "error": str(error["message"]) if error else None,
        "traceback": str(error.get("data", {}).get("traceback", "")) if error else None,
    }


def watch_share_of(own: Iterable[float], took: Iterable[float]) -> float | None:
    """What watching took of the newest steps: their `time/nbwatch` over their step times
    (a batch's record costs one step of the next batch: one step alone misleads)."""
    o = [x for x in own if x == x]
    t = sum(x for x in took if x == x)
    if not o or not t > 0:
        return None
    return min(sum(o) / t, 1.0)


def run_duration(meta: Mapping[str, Any], last_wall: float | None, now: float) -> float | None:
    """How long the run has taken: from its start (`meta["started"]`) to now while it is
    live, else to its newest recorded step. The one duration the header ("elapsed") and the
    export's summary ("wall time") both show."""
    started = meta.get("started")
    if not isinstance(started, (int, float)):
        return None
    state = str(meta.get("state", "unknown"))
    end = now if is_live(state) or last_wall is None else last_wall
    return max(end - float(started), 0.0)
