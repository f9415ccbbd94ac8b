"""The step boundary of a loop of your own: what `Monitor.log()` does once per optimizer
step (the step's record, the queued commands, a stop, what a rewind asks of the loop)."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..recorder import Rewound, StopTraining
from ..records import Event
from .accumulation import one_of_many
from .exiting import raise_if_terminated
from .inputs import check_val, log_figures, mask_samples
from .session import RunSession


class Logged(NamedTuple):
    """What one `log()` returns to the loop: the step recorded (after a rewind, the
    checkpoint's step the weights are now at), the rewind, the batches to skip now."""

    step: int
    rewound: Rewound | None
    skip_batches: int


def log_step(session: RunSession, run_thread: threading.Thread | None, loss: Any,
             mask: torch.Tensor | list[torch.Tensor] | None, val: Any, batch: Any,
             logits: torch.Tensor | None, scalars: dict[str, Any],
             end_loop: Callable[[BaseException | None], None]) -> Logged:
    """Record the step just taken and apply the commands queued for its boundary (pause
    blocks here); a stop ends the run, closes a foreground loop (`end_loop`) and raises
    `StopTraining`."""
    rec = session.recorder_for_log(run_thread)
    count = session.watch.backwards
    micro = count.take() if count is not None else 0  # the step's backward passes
    with rec.own:
        said = one_of_many(loss, max(micro, len(mask) if isinstance(mask, (list, tuple)) else 1))
        rec.note_logged_batch(batch, scalars)  # takes epoch=/index= given with a batch
        host, names, parts, lengths = log_figures(loss, mask, scalars,
                                                  first=rec.step == session.progress_start,
                                                  logits=logits, source=rec.train_logits)
        val = check_val(val)
        host.update(rec.forward_time())  # under torchrun: what tells a straggler
    samples = mask_samples(mask)
    step = rec.record_step(host, names, parts, lengths=lengths, samples=samples, val=val,
                           reduction="as computed by the training loop (mon.log)")
    if said is not None and "accumulation" not in rec.evals.probe_said:  # once a run
        rec.evals.probe_said.add("accumulation")
        warnings.warn(said, stacklevel=3)
        rec.record_event(Event(step, "probe", "warning", said, {"loss": "one micro-batch's"}))
    if rec.boundary():
        rec.finish("stopped")
        if session.mode == "loop":
            end_loop(None)  # closed now, not at exit: a new run can start
        raise StopTraining(f"run {session.setup.name!r} stopped at step {step}, final "
                           "checkpoint written (mon.run() and `with mon:` end the loop "
                           "cleanly)")
    raise_if_terminated(session)  # its step recorded first
    # what a rewind or a skip asks of the loop: said once, at this log(), never merged into
    # a later one
    rw = rec.rewind_state
    skip, rw.skip_batches = rw.skip_batches, 0
    if rw.rewound_to is None:
        return Logged(step, None, skip)
    rewound, rw.rewound_to = Rewound(rw.rewound_to, skip), None
    return Logged(rewound.step, rewound, skip)
