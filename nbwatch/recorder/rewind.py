"""Rewind and skip (PaLM's remedy for a loss spike): reload an earlier checkpoint, keep the
rewound-over steps as a branch, and skip batches of the data stream."""

from __future__ import annotations

from typing import NamedTuple

from ..checkpoint import CheckpointError, load, restore_into
from ..records import Event, Scalars
from ..store import RunReader

BRANCH_KEYS = ("loss/train", "loss/val")  # kept per rewind as rewind/<n>/<key>


class Rewound(NamedTuple):
    """What a rewind did, for a loop of the user's own (`mon.rewound` after `mon.log`):
    the weights are now the checkpoint of `step`; skip the next `skip` batches."""

    step: int
    skip: int


class Rewind:
    """Part of `StepRecorder` (its state is set in `StepRecorder.__init__`)."""

    skip_batches = 0  # the runner discards this many batches before the next step's
    rewinds = 0       # rewinds so far: the branch number of the next
    _mode_runs_loop = False  # set by the Runner: start()'s loop, whose data stream is ours
    _can_rewind = False  # start()'s loop, or a loop of the user's own (not a framework's)
    rewound_to: int | None = None  # the step a rewind went back to, until the loop is told
    _rewound: str | None = None  # what the rewind just applied did, for its skip's event

    def _rewind(self, steps: int, source: str) -> None:
        now = self.step
        target = now - steps
        found = [(s, p) for s, p in self.ckpt.steps() if s <= target]
        if not self._can_rewind:
            return self._refuse("rewind", "a framework runs this loop and keeps its own step "
                                "count: resume it from a checkpoint instead")
        if self.dist is not None:
            return self._refuse("rewind", "not under torchrun yet: every rank would have to "
                                "reload at the same step; resume from a checkpoint instead")
        if not found:
            have = ", ".join(str(s) for s, _ in self.ckpt.steps()) or "none"
            return self._refuse("rewind", f"no checkpoint at or before step {target} "
                                f"(checkpoints at steps: {have}); keep more with keep_last= "
                                "or checkpoint_every=")
        to, path = found[-1]
        try:
            ckpt = load(path)
        except (OSError, CheckpointError) as e:
            return self._refuse("rewind", f"the checkpoint of step {to} cannot be read: {e}")
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
        self.store.truncate_after(to)
        for key, (steps_, values) in gone.items():
            for s, v in zip(steps_.tolist(), values.tolist()):
                self.store.put(Scalars(int(s), {f"rewind/{self.rewinds}/{key}": v}))
        self.step = self.progress.step = self.rewound_to = to
        self._rewound = msg = (f"rewound from step {now} to the checkpoint of step {to} "
                               f"(branch {self.rewinds} keeps steps {to + 1}–{now})")
        self._emit(Event(now, "action", "warning", msg,
                         {"command": "rewind", "value": steps, "from": now, "to": to,
                          "branch": self.rewinds, "source": source}))

    def _skip(self, batches: int, source: str) -> None:
        if not self._can_rewind:
            return self._refuse("skip", "a framework runs this loop: skip batches in its "
                                "data loader")
        self.skip_batches += batches
        if not batches:  # a rewind without a skip: its own event said it all
            self._rewound = None
            return None
        msg = (f"skipping the next {batches} batches of the data stream" if self._mode_runs_loop
               else f"the loop is asked to skip its next {batches} batches (mon.rewound)")
        if self._rewound:  # the second half of one rewind: one answer to one click
            msg, self._rewound = f"{self._rewound}, {msg}", None
        self._emit(Event(self.step, "action", "info", msg,
                         {"command": "skip", "value": batches, "source": source}))

    def _refuse(self, kind: str, why: str) -> None:
        self._emit(Event(self.step, "action", "warning", f"{kind} refused: {why}",
                         {"command": kind, "refused": True}))
