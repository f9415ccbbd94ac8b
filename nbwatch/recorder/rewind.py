"""Rewind and skip (PaLM's remedy for a loss spike): reload an earlier checkpoint, keep the
rewound-over steps as a branch, and skip batches of the data stream."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from ..checkpoint import CheckpointError, load, restore_into
from ..records import Command, CommandKind, Scalars
from ..store import RunReader
from .steering import Applied, Outcome, Refused

BRANCH_KEYS = ("loss/train", "loss/val")  # kept per rewind as rewind/<n>/<key>


class Rewound(NamedTuple):
    """What a rewind did, for a loop of the user's own (`mon.rewound` after `mon.log`):
    the weights are now the checkpoint of `step`; skip the next `skip` batches."""

    step: int
    skip: int


class Rewind:
    """Part of `StepRecorder`: its state (`skip_batches`, `rewinds`, `can_rewind`,
    `runs_loop`, `rewound_to`) is set in `StepRecorder.__init__`."""

    def resolve_rewind(self, cmd: Command) -> Command:
        """The checkpoint a rewind goes back to, decided once (by rank 0 under torchrun,
        before its commands go to every rank): `to`, its step, or `refused`, why not; in
        the payload, so that every rank does the same."""
        if cmd.kind is not CommandKind.REWIND or "to" in cmd.payload or "refused" in cmd.payload:
            return cmd
        target = self.step - int(cmd.payload["steps"])
        if not self.can_rewind:
            why = ("a framework runs this loop and keeps its own step count: resume it from a "
                   "checkpoint instead")
            return replace(cmd, payload={**cmd.payload, "refused": why})
        found = [s for s, _ in self.ckpt.steps() if s <= target]
        if not found:
            have = ", ".join(str(s) for s, _ in self.ckpt.steps()) or "none"
            why = (f"no checkpoint at or before step {target} (checkpoints at steps: {have}); "
                   "keep more with keep_last= or checkpoint_every=")
            return replace(cmd, payload={**cmd.payload, "refused": why})
        return replace(cmd, payload={**cmd.payload, "to": found[-1]})

    def _do_rewind(self, cmd: Command) -> Outcome:
        """One command: go back `steps` and skip `skip` batches, or refuse and change
        nothing (the skip included). Under torchrun every rank takes it at the same step
        and reloads the same checkpoint (an FSDP2 model's shards, together)."""
        cmd = self.resolve_rewind(cmd)
        payload = {k: v for k, v in cmd.payload.items() if k not in ("to", "refused")}
        if "refused" in cmd.payload:
            return Refused(str(cmd.payload["refused"]))
        skip, now, to = int(payload["skip"]), self.step, int(cmd.payload["to"])
        path = dict(self.ckpt.steps()).get(to)
        ckpt, why = None, None
        try:
            if path is None:
                raise OSError(f"no file for step {to} in {self.ckpt.dir} on this rank")
            ckpt = load(path)
        except (OSError, CheckpointError) as e:
            why = f"the checkpoint of step {to} cannot be read: {e}"
        d = self.dist
        if d is not None and not d.all_agree(why is None, "reading a rewind's checkpoint"):
            why = why or (f"the checkpoint of step {to} cannot be read on every rank (the "
                          "run folder must be one that every rank reads)")
        if why is not None or ckpt is None:
            return Refused(why or "unreadable checkpoint")
        self.flush_deferred()
        self.store.flush()
        gone: dict = {}
        taken: list[int] = []
        if d is None or d.rank == 0:  # rank 0 holds the store
            reader = RunReader(self.store.run_dir)
            try:  # what the rewind goes back over; the branch numbers taken (before a resume)
                gone = reader.series(BRANCH_KEYS, to + 1, now + 1)
                names = reader.keys()  # RunReader's stored scalar names
                taken = [int(k.split("/")[1]) for k in names
                         if k.startswith("rewind/") and k.split("/")[1].isdigit()]
            finally:
                reader.close()
        self.rewinds = max([self.rewinds, *taken])
        restore_into(ckpt, self.model, self.opt, self.sched, self.scaler, self.control,
                     self.ckpt.dir)
        self.rewinds += 1
        aside: list = []
        if d is None or d.rank == 0:
            # the abandoned branch's checkpoints are no candidates for resume=True any more
            aside = self.ckpt.set_aside(to, f"rewind/{self.rewinds}")
        self.store.truncate_after(to)
        for key, (steps_, values) in gone.items():
            for s, v in zip(steps_.tolist(), values.tolist()):
                self.store.put(Scalars(int(s), {f"rewind/{self.rewinds}/{key}": v}))
        self.step = self.progress.step = self.rewound_to = to
        self.skip_batches += skip
        then = (f", skipping the next {skip} batches of the data stream" if skip and
                self.runs_loop else f", the loop is asked to skip {skip} batches "
                "(mon.skip_batches)" if skip else "")
        ranks = f" on all {d.world} ranks" if d is not None else ""
        return Applied(f"rewound from step {now} to the checkpoint of step {to}{ranks} "
                       f"(branch {self.rewinds} keeps steps {to + 1}–{now}){then}",
                       severity="warning",
                       data={"from": now, "to": to, "branch": self.rewinds,
                             "set_aside": [p.name for p in aside]})

    def _do_skip(self, cmd: Command) -> Outcome:
        batches = int(cmd.payload["batches"])
        if not self.can_rewind:
            return Refused("a framework runs this loop: skip batches in its data loader")
        self.skip_batches += batches
        return Applied(f"skipping the next {batches} batches of the data stream"
                       if self.runs_loop else
                       f"the loop is asked to skip its next {batches} batches "
                       "(mon.skip_batches)")
