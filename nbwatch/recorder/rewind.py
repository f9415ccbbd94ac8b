"""Rewind and skip (PaLM's remedy for a loss spike): reload an earlier checkpoint, keep the
rewound-over steps as a branch, and skip batches of the data stream."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..alerts.postmortem import KEPT, to_keep
from ..checkpoint import CheckpointError, load, restore_into
from ..controls import scale_lrs
from ..records import Command, CommandKind, Event, Scalars
from ..store import RunReader
from .outcomes import Applied, Outcome, Refused
from .spec import Progress
from .state import InFlight, RewindState

if TYPE_CHECKING:
    from ..checkpoint import Checkpointer
    from ..distributed import Dist, NullStore
    from ..store import RunStore
    from .eval_checkpoint import EvalState
    from .lr_factor import LrFactor

BRANCH_KEYS = ("loss/train", "loss/val")  # kept per rewind as rewind/<n>/<key>


class Rewound(NamedTuple):
    """What a rewind did, for a loop of the user's own (`mon.rewound` after `mon.log`):
    the weights are now the checkpoint of `step`; skip the next `skip` batches."""

    step: int
    skip: int


class Rewinding(Protocol):
    """What a rewind reads and moves of the run it rewinds (a `StepRecorder`)."""

    step: int
    rewind_state: RewindState
    model: Any
    opt: Any
    sched: Any
    scaler: Any
    control: Any
    ckpt: Checkpointer
    store: RunStore | NullStore  # NullStore on ranks > 0
    progress: Progress
    dist: Dist | None
    flight: InFlight
    evals: EvalState
    lr: LrFactor

    def flush_deferred(self) -> None: ...


def resolve_rewind(rec: Rewinding, cmd: Command) -> Command:
    """The checkpoint a rewind goes back to, decided once (by rank 0 under torchrun,
    before its commands go to every rank): `to`, its step, or `refused`, why not; in
    the payload, so that every rank does the same."""
    if cmd.kind is not CommandKind.REWIND or "to" in cmd.payload or "refused" in cmd.payload:
        return cmd
    st = rec.rewind_state
    target = rec.step - int(cmd.payload["steps"])
    if not st.can_rewind:
        why = ("a framework runs this loop and keeps its own step count: resume it from a "
               "checkpoint instead")
        return replace(cmd, payload={**cmd.payload, "refused": why})
    found = [s for s, _ in rec.ckpt.steps() if s <= target]
    if not found:
        have = ", ".join(str(s) for s, _ in rec.ckpt.steps()) or "none"
        back = int(cmd.payload["steps"])
        why = (f"no checkpoint {back} steps back from step {rec.step}, at or before step "
               f"{target} (checkpoints at steps: {have}); rewind fewer steps, or keep more "
               "with keep_last= or checkpoint_every=") if target >= 0 else (
               f"{back} steps back from step {rec.step} is before the run began "
               f"(checkpoints at steps: {have})" + (
                   f": rewind at most {rec.step - rec.ckpt.steps()[0][0]} steps"
                   if rec.ckpt.steps() else ""))
        return replace(cmd, payload={**cmd.payload, "refused": why})
    return replace(cmd, payload={**cmd.payload, "to": found[-1]})

def do_rewind(rec: Rewinding, cmd: Command) -> Outcome:
    """One command: go back `steps` and skip `skip` batches, or refuse and change
    nothing (the skip included). Under torchrun every rank takes it at the same step
    and reloads the same checkpoint (an FSDP2 model's shards, together)."""
    cmd = resolve_rewind(rec, cmd)
    st = rec.rewind_state
    payload = {k: v for k, v in cmd.payload.items() if k not in ("to", "refused")}
    if "refused" in cmd.payload:
        return Refused(str(cmd.payload["refused"]))
    skip, now, to = int(payload["skip"]), rec.step, int(cmd.payload["to"])
    path = dict(rec.ckpt.steps()).get(to)
    ckpt, why = None, None
    try:
        if path is None:
            raise OSError(f"no file for step {to} in {rec.ckpt.dir} on this rank")
        ckpt = load(path)
    except (OSError, CheckpointError) as e:
        why = f"the checkpoint of step {to} cannot be read: {e}"
    d = rec.dist
    if d is not None and not d.all_agree(why is None, "reading a rewind's checkpoint"):
        why = why or (f"the checkpoint of step {to} cannot be read on every rank (the "
                      "run folder must be one that every rank reads)")
    if why is not None or ckpt is None:
        return Refused(why or "unreadable checkpoint")
    rec.flush_deferred()
    rec.store.flush()
    gone: dict = {}
    spikes: list = []
    taken: list[int] = []
    if d is None or d.rank == 0:  # rank 0 holds the store
        reader = RunReader(rec.store.run_dir)
        try:  # what the rewind goes back over; the branch numbers taken (before a resume)
            gone = reader.series(BRANCH_KEYS, to + 1, now + 1)
            spikes = to_keep(reader, to + 1, now)  # their series are the next branch's
            names = reader.keys()  # RunReader's stored scalar names
            taken = [int(k.split("/")[1]) for k in names
                     if k.startswith("rewind/") and k.split("/")[1].isdigit()]
        finally:
            reader.close()
    st.rewinds = max([st.rewinds, *taken])
    c = rec.control
    clip, factor = c.clip, c.lr_factor  # the steering in force holds over the rewind
    restore_into(ckpt, rec.model, rec.opt, rec.sched, rec.scaler, c, rec.ckpt.dir,
                 pending=int(rec.lr.behind()), group=rec.ckpt.group)
    kept = keep_steering(rec, clip, factor)
    # no eval follows the checkpoint gone back to yet; nor does it say where the data now
    # stands, nor the steering kept: a stop right here writes the checkpoint again
    ev = rec.evals
    ev.ckpt_step, ev.last_val, ev.last_val_step = None, None, None
    st.rewinds += 1
    aside: list = []
    if d is None or d.rank == 0:
        # the abandoned branch's checkpoints are no candidates for resume=True any more
        aside = rec.ckpt.set_aside(to, f"rewind/{st.rewinds}")
    rec.store.truncate_after(to)
    fl = rec.flight  # the lengths of the steps gone back over are no data of the next
    fl.seq_lens[:] = [(s, t) for s, t in fl.seq_lens if s <= to]
    for key, (steps_, values) in gone.items():
        for s, v in zip(steps_.tolist(), values.tolist()):
            rec.store.put(Scalars(int(s), {f"rewind/{st.rewinds}/{key}": v}))
    for sid, s, pm in spikes:
        rec.store.put(Event(s, KEPT, "info", f"the post-mortem of the loss spike at step {s}, "
                            f"kept as branch {st.rewinds} leaves the live line",
                            {"spike_id": sid, "branch": st.rewinds, "postmortem": pm}))
    rec.step = rec.progress.step = st.rewound_to = to
    st.skip_batches += skip
    then = (f", skipping the next {skip} batches of the data stream" if skip and
            st.runs_loop else f", the loop is asked to skip {skip} batches "
            "(mon.skip_batches)" if skip else "")
    ranks = f" on all {d.world} ranks" if d is not None else ""
    return Applied(f"rewound from step {now} to the checkpoint of step {to}{ranks} "
                   f"(branch {st.rewinds} keeps steps {to + 1}–{now}){then}{kept}",
                   severity="warning",
                   data={"from": now, "to": to, "branch": st.rewinds,
                         "set_aside": [p.name for p in aside]})

def keep_steering(rec: Rewinding, clip: float | None, factor: float) -> str:
    """Put back the clip and LR factor in force before a rewind loaded the checkpoint's
    (a cut taken with the rewind, an alert's `cut_lr` then `rewind`, must hold); the
    words that say so, for the rewind's event."""
    c = rec.control
    if c.lr_factor != factor:
        if not c.lr_raw:  # the checkpoint's LRs carry its own factor
            scale_lrs(rec.opt, factor / c.lr_factor)
        c.lr_factor = factor
        rec.lr.explained = True
    c.clip = clip
    said = [f"LR ×{factor:g}" if factor != 1.0 else "",
            f"clip {clip:g}" if clip is not None else ""]
    said = [x for x in said if x]
    return f"; {' and '.join(said)} kept" if said else ""


def do_skip(rec: Rewinding, cmd: Command) -> Outcome:
    batches = int(cmd.payload["batches"])
    st = rec.rewind_state
    if not st.can_rewind:
        return Refused("a framework runs this loop: skip batches in its data loader")
    st.skip_batches += batches
    return Applied(f"skipping the next {batches} batches of the data stream"
                   if st.runs_loop else
                   f"the loop is asked to skip its next {batches} batches "
                   "(mon.skip_batches)")
