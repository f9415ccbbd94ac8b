"""Rewind and skip (PaLM's remedy for a loss spike): reload an earlier checkpoint, keep the
rewound-over steps as a branch, and skip batches of the data stream."""

from __future__ import annotations

from typing import NamedTuple

from ..checkpoint import CheckpointError, load, restore_into
from ..records import Command, Scalars
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

    def _do_rewind(self, cmd: Command) -> Outcome:
        """One command: go back `steps` and skip `skip` batches, or refuse and change
        nothing (the skip included)."""
        steps, skip = int(cmd.payload["steps"]), int(cmd.payload["skip"])
        now = self.step
        target = now - steps
        if not self.can_rewind:
            return Refused("a framework runs this loop and keeps its own step count: resume "
                           "it from a checkpoint instead")
        if self.dist is not None:
            return Refused("not under torchrun (DDP or FSDP) yet: every rank would have to "
                           "reload at the same step; resume from a checkpoint instead")
        found = [(s, p) for s, p in self.ckpt.steps() if s <= target]
        if not found:
            have = ", ".join(str(s) for s, _ in self.ckpt.steps()) or "none"
            return Refused(f"no checkpoint at or before step {target} (checkpoints at steps: "
                           f"{have}); keep more with keep_last= or checkpoint_every=")
        to, path = found[-1]
        try:
            ckpt = load(path)
        except (OSError, CheckpointError) as e:
            return Refused(f"the checkpoint of step {to} cannot be read: {e}")
        self.flush_deferred()
        self.store.flush()
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
        return Applied(f"rewound from step {now} to the checkpoint of step {to} (branch "
                       f"{self.rewinds} keeps steps {to + 1}–{now}){then}", severity="warning",
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
