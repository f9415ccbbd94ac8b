"""The run's lifecycle: its states, which are live and which ended, and the one function
that moves a run from one state to the next (refusing a move that cannot happen).

    created ─► starting ─► running ⇄ paused
                  │           │         │
                  │           └─► stopping ◄┘ ─► stopped
                  │           │                   (a stop: button, API, exit, an alert)
                  │           └─► finished        (max_steps, or the loop returned)
                  └─────────────► failed          (from any live state: an exception)

A reader of a run folder (attach, launch, open_run, the dashboard) can say two things
more, never recorded by a writer: `waiting` (no run in the folder yet) and `stale` (the
folder says live, but its writer is gone). `FolderState` holds them, here beside the rest.

A leaf module: everything that reads or shows a run's state (Monitor, the framework
handles, Attached, Run, the dashboard) takes the states and the sets from here.
"""

from __future__ import annotations

from enum import Enum


class RunState(str, Enum):
    """A run's state; compares equal to its name (`mon.state == "running"`)."""

    CREATED = "created"    # a Monitor that has not opened a run yet
    STARTING = "starting"  # opening: the store, the dry run, a framework's setup
    RUNNING = "running"
    PAUSED = "paused"      # the training thread waits at a step boundary
    STOPPING = "stopping"  # a stop was taken: the final checkpoint is being written
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"

    __hash__ = str.__hash__  # a set of states finds the plain string too

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class FolderState(str, Enum):
    """What a reader of a run folder says beyond its writer's `RunState`."""

    WAITING = "waiting"  # no run in the folder yet (attach, launch before the job opens it)
    STALE = "stale"      # its meta says live, but the writer is gone or silent too long
    UNKNOWN = "unknown"  # a folder whose meta holds no state

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


WAITING, STALE = FolderState.WAITING, FolderState.STALE


LIVE: frozenset[RunState] = frozenset(
    {RunState.STARTING, RunState.RUNNING, RunState.PAUSED, RunState.STOPPING})
ENDED: frozenset[RunState] = frozenset({RunState.STOPPED, RunState.FINISHED, RunState.FAILED})

_MOVES: dict[RunState, frozenset[RunState]] = {
    RunState.CREATED: frozenset({RunState.STARTING, RunState.RUNNING, RunState.FAILED}),
    RunState.STARTING: frozenset({RunState.RUNNING, RunState.STOPPING, RunState.STOPPED,
                                  RunState.FINISHED, RunState.FAILED}),
    RunState.RUNNING: frozenset({RunState.PAUSED, RunState.STOPPING, RunState.STOPPED,
                                 RunState.FINISHED, RunState.FAILED}),
    RunState.PAUSED: frozenset({RunState.RUNNING, RunState.STOPPING, RunState.STOPPED,
                                RunState.FINISHED, RunState.FAILED}),  # ended while a pause waited
    RunState.STOPPING: frozenset({RunState.STOPPED, RunState.FAILED}),
    # an ended run opens again only as a new run (a resume): through starting
    RunState.STOPPED: frozenset({RunState.STARTING}),
    RunState.FINISHED: frozenset({RunState.STARTING}),
    RunState.FAILED: frozenset({RunState.STARTING}),
}


class IllegalTransition(RuntimeError):
    """A move between two states that the lifecycle does not allow."""


def transition(current: RunState | str, target: RunState | str) -> RunState:
    """The state after moving from `current` to `target`; raises `IllegalTransition` with
    the reason where the move cannot happen (a finished run cannot pause). Moving to the
    state a run is in already is allowed and changes nothing."""
    cur, to = RunState(current), RunState(target)
    if to is cur or to in _MOVES[cur]:
        return to
    if cur in ENDED:
        why = f"the run has {cur.value}; a new run (resume=True) starts from here"
    else:
        allowed = ", ".join(sorted(s.value for s in _MOVES[cur]))
        why = f"from {cur.value} a run can go to {allowed}"
    raise IllegalTransition(f"a run cannot go from {cur.value} to {to.value}: {why}")


def is_live(state: RunState | str) -> bool:
    """True for starting, running, paused and stopping (not for 'stale' or 'waiting')."""
    return state in _VALUES and RunState(state) in LIVE


def is_ended(state: RunState | str) -> bool:
    return state in _VALUES and RunState(state) in ENDED


_VALUES = frozenset(s.value for s in RunState)


def wire() -> dict[str, list[str]]:
    """The sets as the dashboard page receives them (it keeps no copy of its own)."""
    return {"live": sorted(s.value for s in LIVE), "ended": sorted(s.value for s in ENDED)}
